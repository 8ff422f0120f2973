"""A malformed `num_retractions` is one line from the routed-experts entry point, never an exception
(merge.py: bad data never raises)."""
import pytest

from rollout.routed_experts import MoELayout, encode_sglang, sample_routed_experts
from support.synthetic import synthetic_full

LAY = MoELayout.from_first_k_dense(2, 1, 8, 2)
ROWS = encode_sglang(synthetic_full(2, LAY))


@pytest.mark.parametrize("bad", ["two", "1.5", 1.5, [1], {"n": 1}, -1, True])
def test_malformed_num_retractions_is_a_reason(bad):
    arr, reason = sample_routed_experts({"num_retractions": bad, "routed_experts": ROWS}, 3, LAY)
    assert arr is None and reason == f"meta_info.num_retractions is {bad!r}, expected a count >= 0", reason


def test_well_formed_counts_still_pass():
    for ok in (None, 0):
        arr, reason = sample_routed_experts({"num_retractions": ok, "routed_experts": ROWS}, 3, LAY)
        assert reason is None and arr.shape[0] == 2
