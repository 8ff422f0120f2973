"""`sgl_kernel.utils` names SGLang imports on CUDA (layers/attention/triton_backend.py)."""


def is_arch_support_pdl() -> bool:
    """No programmatic dependent launch: the substitute's ops are plain torch."""
    return False
