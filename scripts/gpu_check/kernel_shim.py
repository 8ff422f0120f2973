"""Kernels for SGLang on a GPU machine that has no SGLang kernel wheel (loaded at interpreter start).

The device's SITE gets scripts/gpu_check/sitecustomize.py, which loads this file in every Python
process of the check (engine, scheduler, detokenizer) and calls `install()`:
- `sgl_kernel` -> the package's torch substitute (sglang_patches/cpu/sgl_kernel_cpu, its CUDA ops in
  cuda_ops.py), by the same finder CPU environments use; a real `sgl_kernel` would win.
- `flashinfer.sampling`, `flashinfer.prefill` (imported at import time on CUDA by SGLang's sampler and
  vision attention; the check runs greedy requests with `--sampling-backend pytorch`) -> stand-ins
  whose names raise an error naming themselves. `flashinfer` itself stays absent, so SGLang's
  `is_flashinfer_available()` is False everywhere.
- kernels "torch" (GPU_CHECK_KERNELS, the default): the `sglang.jit_kernel` functions in
  cuda_ops.JIT_OPS are replaced by the torch versions when their module is imported, so nothing is
  compiled with nvcc; "jit": SGLang's own JIT kernels (the image has nvcc; each compiles on first use).
- the `sglang.jit_kernel` modules in NEEDS_CUTLASS (CuTe-DSL kernels of other models, imported at
  import time on CUDA) -> stand-ins whose names raise, while the `nvidia-cutlass-dsl` package (its
  `cutlass` module, too large to carry) is absent.
Each replaced op prints `gpu-check kernels: first call of NAME` to stderr on its first call.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

KERNELS = ("torch", "jit")
NEEDS_CUTLASS = ("sglang.jit_kernel.dsa.cutedsl_paged_mqa_logits",)
# flashinfer submodules SGLang imports at import time on CUDA (layers/sampler.py, layers/attention/vision.py)
FLASHINFER_STANDINS = ("flashinfer.sampling", "flashinfer.prefill")


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _traced(name, fn):
    seen = []

    def wrapper(*args, **kwargs):
        if not seen:
            seen.append(1)
            print(f"gpu-check kernels: first call of {name}", file=sys.stderr, flush=True)
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__wrapped__ = fn
    return wrapper


class _Replacing(importlib.abc.Loader):
    """Runs the module's own code, then puts the torch ops over the named functions."""

    def __init__(self, inner, table: dict):
        self.inner, self.table = inner, table

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for name, fn in self.table.items():
            setattr(module, name, _traced(f"{module.__name__}.{name}", fn))
        module.GPU_CHECK_TORCH_OPS = sorted(self.table)


class _StandIn(importlib.abc.Loader):
    """A module whose every name is a function raising an error that names it (never called here)."""

    def __init__(self, why: str):
        self.why = why

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        why = self.why

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)

            def _missing(*args, **kwargs):
                raise NotImplementedError(f"gpu-check stand-in: {module.__name__}.{name} is not available ({why})")

            _missing.__name__ = name
            return _missing

        module.__getattr__ = __getattr__


class StandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: tuple, why: str):
        self.names, self.why = set(names), why

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            return importlib.machinery.ModuleSpec(name, _StandIn(self.why))
        return None


class JitFinder(importlib.abc.MetaPathFinder):
    """For the modules of cuda_ops.JIT_OPS (read on the first `sglang.jit_kernel.*` import: torch is
    not imported at interpreter start)."""

    def __init__(self):
        self.table = None

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("sglang.jit_kernel."):
            return None
        if self.table is None:
            self.table = importlib.import_module("sglang_patches.cpu.sgl_kernel_cpu.cuda_ops").JIT_OPS
        if name not in self.table:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Replacing(spec.loader, self.table[name])
        return spec


def standin_module(name: str, why: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__doc__ = f"gpu-check stand-in, not the real module ({why})"
    _StandIn(why).exec_module(mod)
    return mod


def install(kernels: str = "torch") -> list:
    """Install the hooks in this process; returns what was installed (names)."""
    if kernels not in KERNELS:
        raise ValueError(f"GPU_CHECK_KERNELS={kernels!r}: choose from {', '.join(KERNELS)}")
    root = _root()
    if root not in sys.path:
        sys.path.append(root)
    from sglang_patches.cpu import site_hook

    site_hook.install()
    done = ["sgl_kernel"]
    if importlib.util.find_spec("flashinfer") is None:
        for name in FLASHINFER_STANDINS:
            sys.modules.setdefault(name, standin_module(name, "flashinfer is not installed; greedy requests with "
                                                              "--sampling-backend pytorch never call it"))
        done += FLASHINFER_STANDINS
    if importlib.util.find_spec("cutlass") is None and not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder(NEEDS_CUTLASS, "needs nvidia-cutlass-dsl, not carried"))
        done.append("cutlass stand-ins")
    if kernels == "torch" and not any(isinstance(f, JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, JitFinder())
        done.append("sglang.jit_kernel (torch ops)")
    return done
