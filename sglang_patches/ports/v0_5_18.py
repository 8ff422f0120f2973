"""SGLang 0.5.18 (PyPI wheel; Miles' v0.5.18 bump).

0.5.17's hooked source for draft extend, verify padding and the CPU family; 0.5.19's `on_forward_end`
(capturer-extent's pins, and sglang#34319 upstream); the capturer's `__init__` is 0.5.17's, but the module
no longer imports `get_server_args`: the config-bag hook (DP width `get_parallel().dp_size`).
"""
from sglang_patches.fixes import draft_token_count as dtc, routed_experts_rows as rer
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.registry import Port

from . import v0_5_15, v0_5_17, v0_5_19

PORTS = {
    **v0_5_17.PORTS,
    "capturer-extent": v0_5_19.PORTS["capturer-extent"],
    "routed-experts-rows": Port({rer.GROW_DP_SIZE: "957a611caa58a06a"}, test=v0_5_15.FIX_TEST),
    "capture-snapshot": v0_5_19.SNAPSHOT_UPSTREAM,
    "draft-token-count": Port({dtc.COUNT: "9a0c4387d3e0006f"}, test=v0_5_15.FIX_TEST),
    "retraction-rows": Port({rr.KEEP_REQ_IDX: "caff2168f6734304", rr.SPLICE: "d5129896884dfd79",
                             rr.STATE: "ddde0e6b71c3e1cd"}),
}
