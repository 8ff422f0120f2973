"""`sgl_kernel.mamba` names (imported by SGLang's linear-attention backends on CPU):
they resolve at import time and raise an error naming the op when called."""
from ._stubs import missing_names

__getattr__ = missing_names("mamba")
