"""Guard: padding rows captured as routes (sglang#36404) do not reach a request's payload.

Every reviewed release captures top-k in `_post_process_topk_ids` BEFORE the padded-region mask, so the
device capture buffer holds the padding tokens' routes. What reaches a request is decided by the host copy:
`on_forward_end` writes this DP rank's slice of the gathered buffer to `host_cache[out_cache_loc]`; MLP-sync
padding pads `out_cache_loc` with zeros (`_pad_tensor_to_size`), and slot 0 is the KV pool's reserved padding
slot (`TokenToKVPoolAllocator` hands out 1..size). `get_topk` reads a request's `req_to_token` slots only,
so padded rows land in slot 0 and never in a payload.

The reach scenarios `padding_rows_eager` and `padding_rows_decode_graph` (sglang_patches/scenarios/dp.py)
run real SGLang code on every reviewed release (tests/test_version_matrix.py; 0.5.23 in
tests/test_dp_fixes.py, and here in this process). End to end, `tests/test_engine_dp.py::
test_c_every_dp_rank_matches_transformers` (e2e) checks every DP rank's routes against transformers on
configuration (c), where attn_tp alignment pads.
"""
import pytest

pytest.importorskip("sglang.srt.layers.moe.topk")


@pytest.mark.parametrize("name", ["padding_rows_eager", "padding_rows_decode_graph"])
def test_padding_rows_capture_guard(name):
    from sglang_patches.scenarios import dp
    from sglang_patches.scenarios.drivers import pick

    dp.API = dp.API or pick()
    res = dp.SCENARIOS[name]()
    assert dp.KIND[name] == ("padding-rows-capture", "reach")
    assert res["ok"], res["detail"]
    assert "padding routes captured True" in res["detail"]   # the defect's first half is there
