"""The eager-replay stand-in for SGLang's breakable graph backend (0.5.22+'s CUDA default for prefill).

`BreakableCudaGraphBackend` captures a forward as CUDA-graph segments split at `eager_on_graph`
breaks (attention): at replay the segments replay what they recorded, and each break re-runs its
Python function, which reads the live batch (`get_forward_batch()`, the runner's static serving batch).
The prefill runner picks its breakable data flow by `isinstance(backend, BreakableCudaGraphBackend)`
(one request slot, live multi-request metadata, the logits tail on the padded batch), so the stand-in
subclasses it (without its `__init__`, which builds a CUDA graph pool).

Replay re-runs the recorded callable as `EagerReplay` does. The callable enters the capture batch
(`_run_forward`), so the segments read what a graph baked; `LiveBatchAtBreaks` makes each break read
the batch that was current when replay began, as a break does on CUDA. It stands in for SGLang's
capture context (`_current_capture_var`): `eager_on_graph`'s wrapper calls `_end_current_segment()`
before the break's body and `_begin_new_segment()` after it (pinned by `tests/test_cpu_graphs.py`).
Both capture and replay run with SGLang's breakable flag set (`enable_breakable_cuda_graph`), as
`capture_session` / `replay_session` do on CUDA.
"""
import types
from contextlib import contextmanager

from .backend import EagerReplay

CAPTURE_VAR = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
_CLS = None


class LiveBatchAtBreaks:
    """Set as SGLang's current breakable capture during a re-run: every `eager_on_graph` break runs
    with `live` as the current forward batch; the code between breaks keeps its own."""

    _barrier_fn = None

    def __init__(self, live):
        self.live = live
        self.cuda_graph = types.SimpleNamespace(_break_fns=[])
        self._tokens = []
        self.breaks = 0

    def _end_current_segment(self) -> None:
        from sglang.srt.model_executor.runner_utils import forward_batch as fb

        self._tokens.append(fb._current_batch.set(self.live))
        self.breaks += 1

    def _begin_new_segment(self) -> None:
        from sglang.srt.model_executor.runner_utils import forward_batch as fb

        fb._current_batch.reset(self._tokens.pop())
        self.cuda_graph._break_fns.clear()   # a graph keeps them for replay; a re-run does not


def breakable_backend_class():
    global _CLS
    if _CLS is not None:
        return _CLS
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    class EagerBreakableReplayBackend(EagerReplay, BreakableCudaGraphBackend):
        """CPU stand-in for one breakable graph per shape: a recorded callable re-run, breaks on the live batch."""

        @contextmanager
        def capture_session(self, stream):
            with self.replay_session():
                yield

        @contextmanager
        def replay_session(self):
            from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
                enable_breakable_cuda_graph)

            with enable_breakable_cuda_graph():
                yield

        @contextmanager
        def rerun_scope(self):
            import importlib

            from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch

            var = importlib.import_module(CAPTURE_VAR)._current_capture_var
            token = var.set(LiveBatchAtBreaks(get_forward_batch()))
            try:
                yield
            finally:
                var.reset(token)

    _CLS = EagerBreakableReplayBackend
    return _CLS
