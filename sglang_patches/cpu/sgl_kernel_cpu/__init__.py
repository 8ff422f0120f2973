"""CPU substitute for `sgl_kernel` (PyPI ships CUDA builds only).

Served as `sgl_kernel` by `sglang_patches.cpu.site_hook` when no real build is
installed. Ops with a torch implementation are listed in `ops.OPS` (the CPU ops) and
`cuda_ops.OPS` (the ops SGLang calls on CUDA, for a GPU machine without the kernel wheel); any other
name resolves (so SGLang's import-time `from sgl_kernel import X` works) to a
function that raises an error naming the op when called. Importing the package
also registers the attention ops as `torch.ops.sgl_kernel.*` (see attention.py).
"""
import importlib
import os

IS_CPU_SUBSTITUTE = True

_ops = importlib.import_module(__name__ + ".ops")
_cuda_ops = importlib.import_module(__name__ + ".cuda_ops")  # the CUDA-named ops (a GPU without the wheel)
if os.environ.get("SGL_KERNEL_CPU_TRACE") == "1":
    _ops.trace_first_calls()
    _ops.trace_first_calls(_cuda_ops.OPS)
importlib.import_module(__name__ + ".attention").register_torch_ops(_ops.OPS)


class UnimplementedOp(NotImplementedError):
    pass


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _ops.OPS:
        return _ops.OPS[name]
    if name in _cuda_ops.OPS:
        return _cuda_ops.OPS[name]

    def _missing(*args, **kwargs):
        raise UnimplementedOp(f"sgl_kernel CPU substitute: op '{name}' is not implemented")

    _missing.__name__ = name
    return _missing
