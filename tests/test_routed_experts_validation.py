"""Routed experts: every corrupt payload fails with its own one-line reason; the rollout goes on."""
import random

import numpy as np
import pytest

from rollout.routed_experts import validate
from rollout.routed_experts import MoELayout, RoutedExpertsError, decode_compact, encode_sglang, sample_routed_experts
from support.synthetic import synthetic_full

LAY = MoELayout.from_first_k_dense(6, 2, 16, 4)  # layers 0, 1 dense; 2..5 MoE
TOKENS = 9                                         # -> 8 rows
GOOD = synthetic_full(TOKENS - 1, LAY, seed=42)


def _with(r, layer, k, value):
    bad = GOOD.copy()
    bad[r, layer, k] = value
    return encode_sglang(bad)


def _dup():
    bad = GOOD.copy()
    bad[5, 3, 1] = bad[5, 3, 2]
    return encode_sglang(bad)


def _zero_moe_row():
    bad = GOOD.copy()
    bad[2, 4] = 0
    return encode_sglang(bad)


def _extra_layer():  # the draft (MTP) layer's routes appended as a 7th layer
    extra = np.concatenate([GOOD, GOOD[:, -1:]], axis=1)
    return encode_sglang(extra)


def _bad_char():
    s = encode_sglang(GOOD)
    return s[:10] + "!" + s[11:]


# (name, payload, start_len, expected reason fragment)
CASES = [
    ("too_few_rows", lambda: encode_sglang(GOOD[:-1]), 0, "has 7 rows, expected len(tokens)-1-start_len=8"),
    ("bad_base64_char", _bad_char, 0, "is not valid base64 ("),
    ("bad_base64_length", lambda: encode_sglang(GOOD)[:-1], 0, "is not a multiple of 4)"),
    ("out_of_range_id", lambda: _with(3, 4, 0, 16), 0, "expert id 16 >= num_experts=16 at token 3, layer 4"),
    ("negative_id", lambda: _with(6, 2, 3, -1), 0, "negative expert id -1 at token 6, layer 2"),
    ("duplicate_id", _dup, 0, "duplicate expert id in top-k"),
    ("dense_layer_leak", lambda: _with(4, 1, 0, 7), 0, "dense layer 1 carries expert ids [7, 0, 0, 0] at token 4"),
    ("extra_layer", _extra_layer, 0, "carries 7 layers per token, model has 6 (extra or draft layer?)"),
    ("empty", lambda: "", 0, "is empty, expected 8 rows"),
    ("start_len_ignored", lambda: encode_sglang(GOOD), 3, "has 8 rows, expected len(tokens)-1-start_len=5 (covers"),
    ("start_len_out_of_range", lambda: encode_sglang(GOOD), 9, "routed_experts_start_len=9 outside [0, len(tokens)-1=8]"),
    ("not_whole_rows", lambda: encode_sglang(np.concatenate([GOOD.ravel(), [1, 2, 3]])), 0,
     "has 195 values, not a multiple of num_hidden_layers*topk=6*4"),
    ("raw_bytes_not_int32", lambda: GOOD.tobytes()[:-2], 0, "bytes, not a multiple of 4 (int32)"),
    ("wrong_type", lambda: {"routed_experts": "x"}, 0, "has unsupported type dict"),
    ("float_values", lambda: GOOD.astype(float).tolist(), 0, "list holds float64 values, expected integers"),
    ("missing", lambda: None, 0, "is missing (was return_routed_experts set"),
    ("moe_row_all_zero", _zero_moe_row, 0, "MoE layer 4 has no routing (all zeros) at token 2"),
]


@pytest.mark.parametrize("name,make,start_len,reason", CASES, ids=[c[0] for c in CASES])
def test_corrupt_payload_has_one_line_reason(name, make, start_len, reason):
    with pytest.raises(RoutedExpertsError) as err:
        decode_compact(make(), LAY, TOKENS, start_len)
    msg = str(err.value)
    assert reason in msg and "\n" not in msg and len(msg) < 200, msg


def test_reasons_are_distinct():
    msgs = set()
    for _, make, start_len, _ in CASES:
        with pytest.raises(RoutedExpertsError) as err:
            decode_compact(make(), LAY, TOKENS, start_len)
        msgs.add(str(err.value))
    assert len(msgs) == len(CASES) >= 10


def test_bad_sample_fails_alone_rollout_continues():
    metas = [{"routed_experts": encode_sglang(GOOD)}] + [
        {"routed_experts": make(), "routed_experts_start_len": sl} for _, make, sl, _ in CASES] + [
        {"routed_experts": encode_sglang(GOOD)}]
    results = [sample_routed_experts(m, TOKENS, LAY) for m in metas]
    assert all(c is not None and r is None for c, r in (results[0], results[-1]))
    assert all(c is None and r for c, r in results[1:-1])
    np.testing.assert_array_equal(results[0][0], GOOD[:, 2:])


def test_draft_layer_overwrites_target_layer_with_foreign_ids():
    """vllm#48622 style: a draft model with more experts writes into a target MoE layer."""
    lay = MoELayout.from_first_k_dense(4, 1, 8, 2)
    full = synthetic_full(5, lay, seed=1)
    full[:, 3] = [[9, 12]]  # ids of a 16-expert draft model land in layer 3
    comp, reason = sample_routed_experts({"routed_experts": encode_sglang(full)}, 6, lay)
    assert comp is None and reason == "expert id 9 >= num_experts=8 at token 0, layer 3"


@pytest.mark.parametrize("payload,reason", [
    ([[1, 2], [3]], "list is ragged"), ("\u00e9" * 8, "non-ASCII"), (3.5, "unsupported type float"),
    (np.zeros(4, np.float32), "array has dtype float32"),
])
def test_odd_inputs(payload, reason):
    with pytest.raises(RoutedExpertsError, match=reason):
        decode_compact(payload, LAY, TOKENS)
    assert sample_routed_experts("not a dict", TOKENS, LAY) == (None, "meta_info is a str, expected a dict")


def test_mutated_base64_only_ever_gives_a_reason(monkeypatch):
    """Random edits of a good payload (also across block boundaries): a value or a one-line reason."""
    monkeypatch.setattr(validate, "BLOCK_BYTES", 6 * 4 * 4 * 3)  # 3-row blocks
    s, rnd = encode_sglang(GOOD), random.Random(0)
    alphabet = "AQgw/+=!\n\u00e9"
    for _ in range(300):
        t = list(s)
        for _ in range(rnd.randint(1, 3)):
            pos, op = rnd.randrange(len(t)), rnd.random()
            if op < 0.5:
                t[pos] = rnd.choice(alphabet)
            elif op < 0.75:
                del t[pos]
            else:
                t.insert(pos, rnd.choice(alphabet))
        comp, reason = sample_routed_experts({"routed_experts": "".join(t)}, TOKENS, LAY)
        assert (comp is None) != (reason is None)
        assert reason is None or "\n" not in reason
