"""SGLang 0.5.17 (PyPI wheel; slime's next image).

0.5.16's hooked source for capturer-extent, capture-snapshot and most of the CPU family. The capturer
sizes its buffer from `get_schedule()` and `get_parallel().dp_size` but 0.5.17 has no
`max_speculative_num_draft_tokens()`: the hook reads the published ServerArgs, as on 0.5.16.
CPU family: `moe_forward_native` moved (not ported: a CPU engine with EP refuses it).
"""
from sglang_patches.fixes import (draft_extend_real_rows as de, draft_token_count as dtc, routed_experts_rows as rer,
                                  verify_padding_lcm as vpl)
from sglang_patches.registry import Port

from . import v0_5_15, v0_5_16

FIX_TEST = v0_5_15.FIX_TEST
CPU_NOT_PORTED = ("cpu-ep-native-moe",)
PORTS = {
    **{name: port for name, port in v0_5_16.PORTS.items() if name not in CPU_NOT_PORTED},
    "routed-experts-rows": Port({rer.GROW_PUBLISHED_ARGS: "957a611caa58a06a"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "eac55d011907e247"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "ab51259e5e4bafbb"}, test=FIX_TEST),
    "draft-token-count": Port({dtc.COUNT: "c47ef29026e9130f"}, test=FIX_TEST),
}
