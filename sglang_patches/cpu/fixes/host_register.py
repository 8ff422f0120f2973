"""CPU: host caches must not call cudaHostRegister.

`ALLOC_MEMORY_FUNCS` (mem_cache/pool_host/common.py) has no "cpu" entry, so every host cache,
including the routed-experts capturer's `BaseHostCache`, is allocated with
`alloc_with_host_register(pin_memory=True)`, whose `_cuda_host_register` calls
`torch.cuda.cudart()`: `--enable-return-routed-experts` dies at start-up on a CPU-only torch.

Fix: AROUND `_cuda_host_register`: without CUDA there is nothing to register; skip it.
Up to 0.5.19 the routed-experts `BaseHostCache` allocates with `torch.zeros(pin_memory=True)` itself
(not through `_cuda_host_register`), which a CPU-only torch refuses at start-up ("pin_memory=True
requires a CUDA or other accelerator backend"): there an AROUND hook on `BaseHostCache.__init__`
drops pin_memory for that call.
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"
HOST_CACHE_INIT = "sglang.srt.state_capturer.base.BaseHostCache.__init__"


def skip_without_cuda(original, buffer, *args, **kwargs):
    import torch

    if not torch.cuda.is_available():
        return None  # plain host memory already is what a CPU engine uses
    return original(buffer, *args, **kwargs)


def _unpinned_mode():
    """A torch-function mode (thread-local, scoped by `with`): factory calls drop pin_memory=True."""
    from torch.overrides import TorchFunctionMode

    class Unpinned(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            kwargs.pop("pin_memory", None)  # nothing to pin without CUDA: plain host memory
            return func(*args, **kwargs)

    return Unpinned()


def unpinned_host_cache(original, *args, **kwargs):
    """AROUND BaseHostCache.__init__ on a CPU engine: its own torch.zeros(pin_memory=True) gets host memory.
    The mode covers this call on this thread only; module globals and other threads are untouched."""
    import torch

    if torch.cuda.is_available():
        return original(*args, **kwargs)
    with _unpinned_mode():
        return original(*args, **kwargs)


SKIP_REGISTER = Hook(TARGET, skip_without_cuda, "around")
UNPINNED_HOST_CACHE = Hook(HOST_CACHE_INIT, unpinned_host_cache)

FIX = Fix(
    name="cpu-host-register",
    family="cpu",
    defect=(
        "Host caches on a CPU engine are allocated with cudaHostRegister because ALLOC_MEMORY_FUNCS has "
        "no 'cpu' entry. Routed-expert capture therefore crashes at start-up on a CPU-only torch."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-host-register]",
    when=cpu_idle_reason,
)
