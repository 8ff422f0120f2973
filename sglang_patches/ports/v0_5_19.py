"""SGLang 0.5.19 (PyPI wheel; Miles since its v0.5.19 bump).

The capturer reads its sizing from the config bags (`get_schedule`, `get_parallel().dp_size`); no real-rows
path for padded extends (draft extend is hooked on `RadixAttention.forward`); `on_forward_end` already
snapshots its deferred output (sglang#34319, since 0.5.18); no `dp_slot_in` (dp-buffer-sizing not-needed,
as on 0.5.16).
"""
from sglang_patches.fixes import (capturer_extent as ce, draft_extend_real_rows as de, routed_experts_rows as rer,
                                  verify_padding_lcm as vpl)
from sglang_patches.registry import Port
from sglang_patches.states import FixState

from . import v0_5_15, v0_5_16

FIX_TEST, GUARD_TEST = v0_5_15.FIX_TEST, v0_5_15.GUARD_TEST
SNAPSHOT_UPSTREAM = Port(state=FixState.UPSTREAM, test=GUARD_TEST,
                         reason="on_forward_end clones out_cache_loc and the top-k slice (sglang#34319)")
PORTS = {
    **v0_5_16.PORTS,
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "91c7a85d21e49199"},
                            test=FIX_TEST),
    "routed-experts-rows": Port({rer.GROW_DP_SIZE: "5b505564668a5480"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "16cf2680a022d2b2"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "ec8ae0863594cd9a"}, test=FIX_TEST),
    "capture-snapshot": SNAPSHOT_UPSTREAM,
}
