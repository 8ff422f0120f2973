"""`sgl_kernel.quantization`: imported at import time on CUDA by SGLang's layers/quantization/gguf.py (imported by every quantization config)."""
from ._stubs import missing_names

__getattr__ = missing_names("quantization")
