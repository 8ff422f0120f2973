"""SGLang 0.5.20 (PyPI wheel; Miles' pending bump).

0.5.19's hooked source except `prepare_mlp_sync_batch` (re-pinned; the same BEFORE hook).
CPU family: 0.5.23's sources for the host cache (BaseHostCache goes through `_cuda_host_register`),
the AMX fallback, `moe_forward_native`, `all_gatherv` and the thread binding; `reduce_scatterv` and
`all_gather_into_tensor` moved (not ported: refused in a CPU engine).
"""
from sglang_patches.fixes import draft_token_count as dtc, verify_padding_lcm as vpl
from sglang_patches.registry import Port

from . import v0_5_15, v0_5_19, v0_5_23

CPU_NOT_PORTED = ("cpu-gloo-scatter-gather", "cpu-gloo-stacked-allgather")
CPU_AS_0_5_23 = ("cpu-host-register", "cpu-eagle-attn-backend", "cpu-ep-native-moe", "cpu-thread-binding")
PORTS = {
    **{name: port for name, port in v0_5_19.PORTS.items()
       if name not in CPU_NOT_PORTED and not name.startswith("cpu-graphs-")},
    **{name: v0_5_23.PORTS[name] for name in CPU_AS_0_5_23},
    "verify-padding-lcm": Port({vpl.ALIGN: "dd76cb3f2ae1c99a"}, test=v0_5_15.FIX_TEST),
    "draft-token-count": Port({dtc.COUNT_GLOBAL: "e2dc59752e4be5b1"}, test=v0_5_15.FIX_TEST),
}
