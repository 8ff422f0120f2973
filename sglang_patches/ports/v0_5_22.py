"""SGLang 0.5.22 (PyPI wheel).

0.5.23's `on_forward_end` and capturer `__init__` (its hooks and pins); 0.5.21's `prepare_mlp_sync_batch`;
no real-rows path for padded extends yet (draft extend hooked on `RadixAttention.forward`). Its DP
controller process loads plugins: cpu-dp-controller-idle as on 0.5.23.
"""
from sglang_patches.fixes import capturer_extent as ce, draft_extend_real_rows as de, draft_token_count as dtc
from sglang_patches.registry import Port

from . import v0_5_15, v0_5_21, v0_5_23

PORTS = {
    **v0_5_21.PORTS,
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "e289e633c1082b48"},
                            test=v0_5_15.FIX_TEST),
    "routed-experts-rows": v0_5_23.PORTS["routed-experts-rows"],
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "3b3d211412fd8c82"}, test=v0_5_15.FIX_TEST),
    "cpu-dp-controller-idle": v0_5_23.PORTS["cpu-dp-controller-idle"],
    "draft-token-count": Port({dtc.COUNT_GLOBAL: "01b5d0ced0bda937"}, test=v0_5_15.FIX_TEST),
    "retraction-rows": v0_5_23.PORTS["retraction-rows"],
}
