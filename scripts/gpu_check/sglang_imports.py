"""Import SGLang on the device machine without `sgl_kernel`.

`sgl_kernel` (the sglang-kernel 0.4.4 wheel SGLang 0.5.15.post1 pins, 615 MB) cannot travel, and
SGLang's modules import it at import time under `if _is_cuda:` (fp8_utils, w8a8_int8, gguf, qoq...).
Inside `imports_without_cuda()` torch reports no CUDA, so those imports are skipped; afterwards
SGLang's lru-cached `is_cuda()` is cleared and answers truthfully. Only code without import-time
CUDA flags may be judged after such an import (the checks name what they run).
"""
from contextlib import contextmanager


@contextmanager
def imports_without_cuda():
    from unittest import mock

    import torch

    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        yield
    from sglang.srt.utils.common import is_cuda

    is_cuda.cache_clear()
