"""The eager-replay graph backend and the stand-ins for CUDA-only primitives.

`EagerReplayBackend` implements SGLang's `BaseCudaGraphBackend` contract without CUDA graphs:
`capture_one` runs the same two warm-ups as `FullCudaGraphBackend`, then one recorded run,
and keeps the forward callable plus that run's output; `replay` re-runs the callable (in
capture mode, as the graph was recorded) on the runner's static buffers and copies the result
into the recorded output, so output tensors stay fixed as with a graph. Everything else
(bucket choice, padding, `fill_from`, capturers, output slicing) is the runner's own code.

It subclasses `FullCudaGraphBackend` without running its `__init__` (which builds a CUDA graph
memory pool): the prefill runner picks its data flow by `isinstance(backend, FullCudaGraphBackend)`.

Up to 0.5.19 a prefill graph runs attention through SGLang custom ops registered for the CUDA
dispatch key only (0.5.23 runs it eagerly there), and on 0.5.15.post1 a DP-attention capture's
collectives go through such ops too (`reg_reduce_scatter_tensor`, `reg_all_gather_into_tensor`; 0.5.19
calls the group's own collective on CPU): `cpu_kernels_for_cuda_only_ops` gives them a CPU kernel that
redispatches to that registration, the op's own device-agnostic Python function.

Limit: Python reruns at replay, so values a real graph would bake in while Python reads them
live (e.g. torch_native looping over live `seq_lens`) are not reproduced; data-flow defects are.
"""
import dataclasses
import logging
from contextlib import contextmanager

import torch

logger = logging.getLogger("slime_moe_rollout")
FIRST_REPLAY = "slime-moe-rollout: CPU graph replay: first replay of"

_FULL = None


def full_backend_cls():
    global _FULL
    if _FULL is None:
        from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

        _FULL = FullCudaGraphBackend
    return _FULL


def copy_into(captured, fresh, where: str = "output") -> None:
    """Copy a replay's output into the captured one, leaf by leaf (tensors only)."""
    if torch.is_tensor(captured):
        if not torch.is_tensor(fresh) or fresh.shape != captured.shape:
            got = tuple(fresh.shape) if torch.is_tensor(fresh) else type(fresh).__name__
            raise RuntimeError(f"eager replay: {where} is {got}, captured {tuple(captured.shape)}")
        if fresh.data_ptr() != captured.data_ptr():
            captured.copy_(fresh)
    elif dataclasses.is_dataclass(captured) and not isinstance(captured, type):
        for f in dataclasses.fields(captured):
            copy_into(getattr(captured, f.name), getattr(fresh, f.name, None), f"{where}.{f.name}")
    elif isinstance(captured, (list, tuple)):
        for i, (c, n) in enumerate(zip(captured, fresh)):
            copy_into(c, n, f"{where}[{i}]")
    elif isinstance(captured, dict):
        for k, c in captured.items():
            copy_into(c, fresh[k], f"{where}[{k!r}]")
    elif hasattr(captured, "tensors"):  # PPProxyTensors
        copy_into(captured.tensors, fresh.tensors, f"{where}.tensors")
    # None / Python scalars: a graph returns what was captured


CUDA_ONLY_OPS = ("unified_attention_with_output", "unified_attention_with_output_and_lse",
                 "reg_reduce_scatter_tensor", "reg_all_gather_into_tensor")
_LIBS = []  # keeps the CPU kernel registrations alive


def cpu_kernels_for_cuda_only_ops(names=CUDA_ONLY_OPS, namespace="sglang") -> list:
    """Register a CPU kernel for each `<namespace>::<name>` op that has a CUDA kernel only; returns those names."""
    done = []
    for name in names:
        qual = f"{namespace}::{name}"
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        ns = getattr(torch.ops, namespace)
        if not hasattr(ns, name) or has(qual, "CPU") or not has(qual, "CUDA"):
            continue
        op = getattr(ns, name).default
        cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)

        def kernel(*args, _op=op, **kwargs):
            return _op.redispatch(cuda, *args, **kwargs)

        lib = torch.library.Library(namespace, "IMPL")
        lib.impl(name, kernel, "CPU")
        _LIBS.append(lib)
        done.append(name)
    return done


def make_backend(cuda_graph_runner, breakable: bool = False, **_options):
    """An eager-replay backend for `cuda_graph_runner` (options of the CUDA backends are moot);
    `breakable`: the stand-in for SGLang's `BreakableCudaGraphBackend` (`breakable.py`)."""
    cpu_kernels_for_cuda_only_ops()
    if breakable:
        from .breakable import breakable_backend_class

        cls = breakable_backend_class()
    else:
        cls = _backend_class()
    backend = cls.__new__(cls)
    backend._setup(cuda_graph_runner)
    return backend


class EagerReplay:
    """Capture records the forward callable and its output; replay re-runs it on the static buffers."""

    def _setup(self, cuda_graph_runner) -> None:
        self._cuda_graph_runner = cuda_graph_runner
        self._fns = {}
        self._outputs = {}
        self._replayed = set()
        self.replays = 0

    @contextmanager
    def capture_session(self, stream):
        yield  # no graph pool, no capture stream on CPU

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None, **_ignored):
        # _ignored: 0.5.15.post1's `dummies` (inputs a CUDA graph keeps alive; a re-run needs none)
        from sglang.srt.runtime_context import get_parallel

        for _ in range(2):  # the CUDA backend's warm-ups: one-time setup before the recorded run
            get_parallel().tp_group.barrier()
            forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        self._outputs[shape_key] = forward_fn()
        self._fns[shape_key] = forward_fn

    def can_run(self, forward_batch, shape_key) -> bool:
        return shape_key in self._fns

    @contextmanager
    def replay_session(self):
        yield

    @contextmanager
    def rerun_scope(self):
        """What a re-run runs under: capture mode, as the full graph was recorded."""
        from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

        with model_capture_mode():
            yield

    def replay(self, shape_key, static_forward_batch, **kwargs):
        # The prefill runner points layer_model.forward at a function calling replay();
        # the recorded callable calls layer_model.forward: undo that while re-running it.
        layer_model = getattr(self._cuda_graph_runner, "layer_model", None)
        redirect = layer_model.__dict__.pop("forward", None) if layer_model is not None else None
        try:
            with self.rerun_scope():
                fresh = self._fns[shape_key]()
        finally:
            if redirect is not None:
                layer_model.forward = redirect
        if shape_key not in self._replayed:  # one line per graph: the replay path ran here
            self._replayed.add(shape_key)
            logger.warning("%s %s %s", FIRST_REPLAY, type(self._cuda_graph_runner).__name__, shape_key)
        self.replays += 1
        captured = self._outputs[shape_key]
        copy_into(captured, fresh)
        return captured

    def cleanup(self) -> None:
        self._fns.clear()
        self._outputs.clear()


_CLS = None


def _backend_class():
    global _CLS
    if _CLS is None:
        _CLS = type("EagerReplayBackend", (EagerReplay, full_backend_cls()), {
            "__doc__": "CPU stand-in for one CUDA graph per shape: a recorded callable re-run on static buffers."})
    return _CLS


class CpuDeviceModuleStandIn:
    """Stand-in for a runner's device module on CPU: `torch.cpu` plus the CUDA-only stream
    capture query (`is_current_stream_capturing`), which eager replay answers with False:
    no stream is ever recording."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False
