"""`sgl_kernel.mamba` names (imported by SGLang's linear-attention backends on CPU):
they resolve at import time and raise an error naming the op when called."""
from . import UnimplementedOp


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise UnimplementedOp(f"sgl_kernel CPU substitute: op 'mamba.{name}' is not implemented")

    _missing.__name__ = name
    return _missing
