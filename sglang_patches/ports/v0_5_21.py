"""SGLang 0.5.21 (PyPI wheel).

`dp_slot_in` resolves one-entry per-rank lists (dp-buffer-sizing upstream, as on 0.5.23); the capturer's
`__init__` is 0.5.19's (config-bag hook, DP width `get_parallel().dp_size`); no real-rows path for padded
extends (draft extend hooked on `RadixAttention.forward`); `on_forward_end` snapshots (sglang#34319).
CPU family: 0.5.23's sources except `all_gather_into_tensor` (moved: not ported); the DP controller
process does not load plugins yet (not-needed, as up to 0.5.16).
"""
from sglang_patches.fixes import (capturer_extent as ce, draft_extend_real_rows as de, draft_token_count as dtc,
                                  verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.registry import Port
from sglang_patches.states import FixState

from . import v0_5_15, v0_5_19, v0_5_23

FIX_TEST = v0_5_15.FIX_TEST
CPU_AS_0_5_23 = ("cpu-host-register", "cpu-cuda-synchronize", "cpu-eagle-attn-backend", "cpu-torch-native-fill",
                 "cpu-ep-native-moe", "cpu-gloo-scatter-gather", "cpu-thread-binding")
PORTS = {
    **{name: v0_5_19.PORTS[name] for name in ("routed-experts-rows", "capture-snapshot", "verify-logits-truncation",
                                              "heartbeat-reset", "padding-rows-capture")},
    **{name: v0_5_23.PORTS[name] for name in CPU_AS_0_5_23},
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "0a38d0e68ca93201"},
                            test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "1da7ccd202fe0dfe"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "23415531c9f4d621"}, test=FIX_TEST),
    "dp-buffer-sizing": Port(state=FixState.UPSTREAM, test=v0_5_15.GUARD_TEST,
                             reason="one-entry per-rank lists are resolved via dp_slot_in"),
    "cpu-dp-controller-idle": v0_5_15.DP_CONTROLLER_UNREACHABLE,
    "draft-token-count": Port({dtc.COUNT_GLOBAL: "a7e61b4cbd9bf676"}, test=FIX_TEST),
    "accepted-path-rows": v0_5_23.PORTS["accepted-path-rows"],
    "retraction-rows": Port({rr.KEEP: "8927d8193e9b876c", rr.SPLICE: "0a42f229acf94e72", rr.STATE: "153426e70898ed8b"}),
}
