"""The stop-edge routed-experts row: a payload with `len(tokens) - start_len` rows instead of
`len(tokens) - 1 - start_len`, the last one the routing of the final token (Miles drops such a
row). The reviewed SGLang releases do not send it: `get_topk` stops at
`seqlen - 1` with `seqlen = len(origin_input_ids) + len(output_ids_through_stop)`; the real CPU engine
(tests/test_next_defects_rows_engine.py) returns exactly `len(tokens) - 1` rows for every ending (stop
token, stop string with and without trimming, max tokens, abort, a continued sample), with and without
NEXTN. An engine that does send it must not fail the sample: validation keeps the rows that feed
training positions and drops the extra one.
"""
import numpy as np
import pytest

from rollout.routed_experts import MoELayout, RoutedExpertsError, decode_compact, encode_sglang
from support.synthetic import synthetic_full

LAY = MoELayout.from_first_k_dense(6, 2, 16, 4)
TOKENS = 9  # 8 rows feed training positions
FULL = synthetic_full(TOKENS, LAY, seed=7)  # one row more: the stop-edge row last


@pytest.mark.parametrize("as_array", [False, True])
def test_stop_edge_row_is_dropped_and_the_rows_kept(as_array):
    payload = FULL.astype(np.int32) if as_array else encode_sglang(FULL)
    got = decode_compact(payload, LAY, TOKENS)
    want = decode_compact(encode_sglang(FULL[: TOKENS - 1]), LAY, TOKENS)
    assert got.shape == (TOKENS - 1, 4, 4) and np.array_equal(got, want)
    assert np.array_equal(got, FULL[: TOKENS - 1, 2:])


def test_stop_edge_row_with_a_start_len():
    start = 3  # a continued sample: rows [3, 8) plus the stop-edge row
    got = decode_compact(encode_sglang(FULL[start:]), LAY, TOKENS, start_len=start)
    assert np.array_equal(got, FULL[start : TOKENS - 1, 2:])


def test_two_extra_rows_still_fail():
    two = np.concatenate([FULL, FULL[-1:]])
    with pytest.raises(RoutedExpertsError, match=r"routed_experts has 10 rows, expected len\(tokens\)-1-start_len=8"):
        decode_compact(encode_sglang(two), LAY, TOKENS)


def test_one_extra_row_with_start_len_1_is_a_whole_sequence_payload():
    """start_len 1 and one extra row: the whole sequence (start ignored) looks the same; fail loudly."""
    with pytest.raises(RoutedExpertsError, match=r"has 8 rows, expected len\(tokens\)-1-start_len=7 \(covers the "
                                                 r"whole sequence: routed_experts_start_len ignored\?\)"):
        decode_compact(encode_sglang(FULL[: TOKENS - 1]), LAY, TOKENS, start_len=1)


def test_a_bad_stop_edge_row_is_not_read():
    """The dropped row is not validated: it feeds no position (its ids may be anything)."""
    bad = FULL.copy()
    bad[-1] = -1
    assert decode_compact(encode_sglang(bad), LAY, TOKENS).shape == (TOKENS - 1, 4, 4)
