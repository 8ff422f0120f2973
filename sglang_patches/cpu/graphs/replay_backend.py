"""CPU graphs: the runners' capture backends and device module are CUDA-only.

`resolve_decode_backend` / `resolve_prefill_backend` (runner_backend/utils.py) return
`FullCudaGraphBackend` / `BreakableCudaGraphBackend`, which need `torch.cuda.CUDAGraph`, a graph
memory pool and `device_module.graph`; and `DecodeCudaGraphRunner` asks its device module
`is_current_stream_capturing()` (decode_cuda_graph_runner.py :658), which `torch.cpu` lacks.

Fix: AROUND both resolvers: on a CPU runner return the eager-replay backend
(`backend.EagerReplayBackend`; for a prefill runner asking for `breakable`, the breakable stand-in
in `breakable.py`, so the runner takes its breakable data flow). AFTER `BaseRunner.__init__`: give
a CPU runner the device module stand-in (`torch.cpu` plus a capture query answering False).
"""
from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

DECODE = "sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend"
PREFILL = "sglang.srt.model_executor.runner_backend.utils.resolve_prefill_backend"
RUNNER_INIT = "sglang.srt.model_executor.runner.base_runner.BaseRunner.__init__"


def replay_backend(original, cuda_graph_runner, *args, **kwargs):
    if graphs_on() and cuda_graph_runner.model_runner.device == "cpu":
        from .backend import make_backend  # torch: imported inside the engine only

        breakable = getattr(cuda_graph_runner, "prefill_backend_name", None) == "breakable"
        return make_backend(cuda_graph_runner, breakable=breakable)
    return original(cuda_graph_runner, *args, **kwargs)


def cpu_device_module(result, self, *args, **kwargs):
    if graphs_on() and self.device == "cpu":
        from .backend import CpuDeviceModuleStandIn

        self.device_module = CpuDeviceModuleStandIn()
    return None


DECODE_BACKEND = Hook(DECODE, replay_backend, "around")
PREFILL_BACKEND = Hook(PREFILL, replay_backend, "around")
DEVICE_MODULE = Hook(RUNNER_INIT, cpu_device_module, "after")

FIX = Fix(
    name="cpu-graphs-replay-backend",
    family="cpu",
    defect=(
        "SGLang's graph runners capture through torch.cuda.CUDAGraph, a CUDA graph pool and a device module "
        "with stream-capture queries. None of these exist on CPU, so no runner can capture or replay there."
    ),
    reference="found running SGLang's graph runners on CPU",
    test="tests/test_cpu_graphs.py::test_decode_graph_one_rank_equals_eager",
    when=graphs_idle_reason,
)
