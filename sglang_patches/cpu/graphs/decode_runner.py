"""CPU graphs: a CPU engine never builds SGLang's decode graph runner, nor sends it DP batches.

1. `capture_decode_graph` returns no runner on CPU without torch.compile and maps `cpu` to
   `CPUGraphRunner` (cuda_graph_setup.py, 0.5.23 :735, :774), which refuses DP attention and
   speculative decoding.
2. `ModelRunner` asks `ForwardMode.is_cpu_graph` on CPU (model_runner.py :1987), which admits
   DECODE only: under DP attention an IDLE rank then runs eagerly while its peer replays, and
   their collectives disagree (gloo: "Received data size doesn't match expected size").

Fix: AROUND `capture_decode_graph`: when SGLang built no runner on a CPU target worker with a
decode graph configured, build `model_runner._decode_cuda_graph_runner_cls()` (the CUDA
`DecodeCudaGraphRunner`). AROUND `ForwardMode.is_cpu_graph`: answer as `is_cuda_graph`
(DECODE, TARGET_VERIFY, IDLE), the modes that runner captures.
0.5.15.post1 has the same early return inside `ModelRunner.init_decode_cuda_graph`, which sets
`decode_cuda_graph_runner` itself: an AFTER hook there builds the runner when that method left none.
"""
import logging
import time

from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

CAPTURE = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_decode_graph"
INIT_DECODE = "sglang.srt.model_executor.model_runner.ModelRunner.init_decode_cuda_graph"  # 0.5.15.post1
MODE = "sglang.srt.model_executor.forward_batch_info.ForwardMode.is_cpu_graph"
logger = logging.getLogger("slime_moe_rollout")


def wants_decode_runner(model_runner) -> bool:
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

    return (
        model_runner.device == "cpu"
        and model_runner.is_generation
        and not model_runner.is_draft_worker
        and not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
    )


def new_decode_runner(model_runner) -> tuple:
    """(SGLang's CUDA decode graph runner built for `model_runner`, seconds its capture took)."""
    if hasattr(model_runner, "_decode_cuda_graph_runner_cls"):
        cls = model_runner._decode_cuda_graph_runner_cls()
    else:  # 0.5.15.post1
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner as cls
    tic = time.perf_counter()
    runner = cls(model_runner)
    took = time.perf_counter() - tic
    logger.warning("slime-moe-rollout: CPU graph replay: %s captured bs=%s in %.1f s",
                   type(runner).__name__, runner.capture_bs, took)
    return runner, took


def build_decode_runner(original, *args, **kwargs):
    capture = original(*args, **kwargs)
    model_runner = kwargs.get("model_runner", args[0] if args else None)
    if capture.runner is not None or not graphs_on() or not wants_decode_runner(model_runner):
        return capture
    import msgspec

    runner, took = new_decode_runner(model_runner)
    return msgspec.structs.replace(capture, runner=runner, capture_time=took)


def build_decode_runner_after_init(result, self, *args, **kwargs):
    if self.decode_cuda_graph_runner is None and graphs_on() and wants_decode_runner(self):
        self.decode_cuda_graph_runner = new_decode_runner(self)[0]
    return None


def cuda_graph_modes(original, self, *args, **kwargs):
    if graphs_on():
        return self.is_cuda_graph()
    return original(self, *args, **kwargs)


BUILD_DECODE_RUNNER = Hook(CAPTURE, build_decode_runner, "around")
BUILD_AFTER_INIT = Hook(INIT_DECODE, build_decode_runner_after_init, "after")
GRAPH_MODES = Hook(MODE, cuda_graph_modes, "around")

FIX = Fix(
    name="cpu-graphs-decode-runner",
    family="cpu",
    defect=(
        "On CPU, SGLang builds no decode graph runner without torch.compile (or CPUGraphRunner, which refuses "
        "DP attention and speculative decoding), and dispatches DECODE batches only to it. The CUDA runner's "
        "decode/verify replay logic never runs on CPU; under DP an IDLE rank would run eagerly beside a replaying peer."
    ),
    reference="found running SGLang's graph runners on CPU",
    test="tests/test_cpu_graphs.py::test_decode_graph_one_rank_equals_eager",
    when=graphs_idle_reason,
)
