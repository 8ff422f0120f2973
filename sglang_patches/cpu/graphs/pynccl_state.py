"""CPU graphs: graph capture switches on a PyNccl communicator that is unavailable on CPU.

`GroupCoordinator.graph_capture` (parallel_state.py, 0.5.23 :662) calls
`pynccl_comm.change_state(enable=True)` whenever the communicator object exists. On CPU it
exists but is unavailable (no NCCL), so collectives inside a DP capture went to
`pynccl.all_gather` and crashed.

Fix: AROUND `PyNcclCommunicator.change_state`: never enable an unavailable communicator
(the collectives stay on gloo, as in eager mode).
"""
from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

TARGET = "sglang.srt.distributed.device_communicators.pynccl.PyNcclCommunicator.change_state"


def keep_unavailable_off(original, self, enable=None, *args, **kwargs):
    if enable and graphs_on() and not getattr(self, "available", True):
        enable = False
    return original(self, enable, *args, **kwargs)


KEEP_OFF = Hook(TARGET, keep_unavailable_off, "around")

FIX = Fix(
    name="cpu-graphs-pynccl-state",
    family="cpu",
    defect=(
        "Graph capture enables the PyNccl communicator whenever it exists, even when it is unavailable. "
        "On CPU, collectives inside a DP-attention capture then call NCCL and crash."
    ),
    reference="found running SGLang's graph runners on CPU",
    test="tests/test_cpu_graphs.py::test_unavailable_pynccl_stays_off_in_capture",
    when=graphs_idle_reason,
)
