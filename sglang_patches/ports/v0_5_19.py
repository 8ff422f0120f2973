"""SGLang 0.5.19 (PyPI wheel; Miles since its v0.5.19 bump).

The capturer reads its sizing from the config bags (`get_schedule`, `get_parallel().dp_size`); no real-rows
path for padded extends (draft extend is hooked on `RadixAttention.forward`); `on_forward_end` already
snapshots its deferred output (sglang#34319, since 0.5.18); no `dp_slot_in` (dp-buffer-sizing not-needed,
as on 0.5.16).
CPU family: 0.5.23's `_cuda_host_register` and AMX fallback, but the routed-experts host cache still pins
its own buffer (both hooks); `moe_forward_native`, `all_gather_into_tensor` and `init_threads_binding`
moved (not ported: refused in a CPU engine).
"""
from sglang_patches.cpu.fixes import host_register as hr
from sglang_patches.fixes import (capturer_extent as ce, draft_extend_real_rows as de, draft_token_count as dtc,
                                  routed_experts_rows as rer, verify_padding_lcm as vpl)
from sglang_patches.registry import Port
from sglang_patches.states import FixState

from . import v0_5_15, v0_5_16, v0_5_23

FIX_TEST, GUARD_TEST = v0_5_15.FIX_TEST, v0_5_15.GUARD_TEST
SNAPSHOT_UPSTREAM = Port(state=FixState.UPSTREAM, test=GUARD_TEST,
                         reason="on_forward_end clones out_cache_loc and the top-k slice (sglang#34319)")
CPU_NOT_PORTED = ("cpu-ep-native-moe", "cpu-gloo-stacked-allgather", "cpu-thread-binding")
PORTS = {
    **{name: port for name, port in v0_5_16.PORTS.items() if name not in CPU_NOT_PORTED},
    "cpu-host-register": Port({hr.SKIP_REGISTER: "f13fb8ab7ebf962a", hr.UNPINNED_HOST_CACHE: "24c16491a52570c3"},
                              test=v0_5_15.ENGINE_TEST),
    "cpu-eagle-attn-backend": v0_5_23.PORTS["cpu-eagle-attn-backend"],
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "91c7a85d21e49199"},
                            test=FIX_TEST),
    "routed-experts-rows": Port({rer.GROW_DP_SIZE: "5b505564668a5480"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "16cf2680a022d2b2"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "ec8ae0863594cd9a"}, test=FIX_TEST),
    "capture-snapshot": SNAPSHOT_UPSTREAM,
    "draft-token-count": Port({dtc.COUNT: "d371f05cb690ec0a"}, test=FIX_TEST),
}
