"""CPU: host caches must not call cudaHostRegister.

`ALLOC_MEMORY_FUNCS` (mem_cache/pool_host/common.py) has no "cpu" entry, so every host cache,
including the routed-experts capturer's `BaseHostCache`, is allocated with
`alloc_with_host_register(pin_memory=True)`, whose `_cuda_host_register` calls
`torch.cuda.cudart()`: `--enable-return-routed-experts` dies at start-up on a CPU-only torch.

Fix: AROUND `_cuda_host_register`: without CUDA there is nothing to register; skip it.
Reference: cpu-moe-eagle-dpattn.md Q2 (patch "hostreg").
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"


def skip_without_cuda(original, buffer, *args, **kwargs):
    import torch

    if not torch.cuda.is_available():
        return None  # plain host memory already is what a CPU engine uses
    return original(buffer, *args, **kwargs)


FIX = Fix(
    name="cpu-host-register",
    family="cpu",
    defect=(
        "Host caches on a CPU engine are allocated with cudaHostRegister because ALLOC_MEMORY_FUNCS has "
        "no 'cpu' entry. Routed-expert capture therefore crashes at start-up on a CPU-only torch."
    ),
    reference="cpu-moe-eagle-dpattn.md Q2 (hostreg)",
    versions=("0.5.23",),
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-host-register]",
    hooks=(Hook(TARGET, skip_without_cuda, "around"),),
    fingerprints={"0.5.23": {TARGET: "f13fb8ab7ebf962a"}},
    when=cpu_idle_reason,
)
