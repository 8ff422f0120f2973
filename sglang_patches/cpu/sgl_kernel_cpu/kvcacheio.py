"""`sgl_kernel.kvcacheio`: imported at import time on CUDA by SGLang's mem_cache/memory_pool_host.py (hierarchical cache)."""
from ._stubs import missing_names

__getattr__ = missing_names("kvcacheio")
