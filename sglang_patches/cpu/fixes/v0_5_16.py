"""The CPU fix family on stock SGLang 0.5.16 (Miles): 0.5.15.post1's ports, one more.

Every target 0.5.15.post1's ports hook (`PINS` there, and `BaseHostCache.__init__`, which pins with
`torch.zeros(pin_memory=True)` itself) has the same source on 0.5.16: the same hooks, the same
fingerprints. `cpu-thread-binding`: 0.5.16's ModelRunner calls `numa_utils.init_threads_binding(
tp_rank=, tp_size=)` (0.5.23: numa_index=, world_size=), which asserts tp_size <= NUMA nodes when
SGLANG_CPU_OMP_THREADS_BIND is unset: 0.5.23's hook, reading tp_size, is ported.
"""
from sglang_patches.registry import Port

from . import thread_binding as tb
from .v0_5_15 import ports

V = "0.5.16"
TEST = "tests/test_engine_v0_5_15.py::test_a_routed_experts_match_transformers[0.5.16]"
BIND_TEST = "tests/test_engine_v0_5_15.py::test_thread_binding_on_0_5_16"
PORTS = ports(V, TEST)
PORTS[tb.FIX.name] = {V: Port(hooks=tb.FIX.ports["0.5.23"].hooks, fingerprints={tb.TARGET: "65ce8574b7efee2a"},
                              test=BIND_TEST)}
