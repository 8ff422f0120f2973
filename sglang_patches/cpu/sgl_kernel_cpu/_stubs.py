"""Submodules of `sgl_kernel` that SGLang imports at import time on CUDA but whose ops the checked
configurations never call: each name resolves, and raises an error naming the op when called."""
from . import UnimplementedOp


def missing_names(module: str):
    """A module `__getattr__` for `sgl_kernel.<module>`."""

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def _missing(*args, **kwargs):
            raise UnimplementedOp(f"sgl_kernel CPU substitute: op '{module}.{name}' is not implemented")

        _missing.__name__ = name
        return _missing

    return __getattr__
