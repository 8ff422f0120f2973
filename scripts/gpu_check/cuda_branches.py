"""GPU check: the `torch.cuda.is_available()` branches of the CPU fix family, never run with a GPU.

On a CUDA machine each must leave SGLang's own behaviour alone (real SGLang 0.5.15.post1 functions
where the hook wraps one). Prints one JSON object {name: {"ok", "detail"}}, or {"skip": reason}.
"""
import json
import os
import sys


def run() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skip": "no CUDA device"}
    from sglang_imports import imports_without_cuda

    with imports_without_cuda():
        import sglang.srt.mem_cache.pool_host.common  # noqa: F401
        import sglang.srt.state_capturer.base  # noqa: F401
    out = {}
    from sglang_patches.cpu.fixes import cpu_idle_reason

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # even when asked for the CPU engine, a GPU machine is not one
    reason = cpu_idle_reason()
    del os.environ["SGLANG_USE_CPU_ENGINE"]
    out["cpu_idle_reason"] = {"ok": reason == "CUDA is available: not a CPU engine", "detail": repr(reason)}

    from sglang_patches.cpu.fixes.host_register import skip_without_cuda
    from sglang.srt.mem_cache.pool_host.common import _cuda_host_register, _cuda_host_unregister

    buf, calls = torch.zeros(1 << 16, dtype=torch.int32), []
    skip_without_cuda(lambda b: (calls.append(1), _cuda_host_register(b)), buf)
    pinned = buf.is_pinned()
    _cuda_host_unregister(buf)
    out["host_register"] = {"ok": calls == [1], "detail": f"SGLang's _cuda_host_register ran: {calls == [1]}, "
                                                          f"buffer pinned: {pinned}"}

    from sglang_patches.cpu.fixes.host_register import unpinned_host_cache
    from sglang.srt.state_capturer.base import BaseHostCache

    cache = object.__new__(BaseHostCache)
    unpinned_host_cache(BaseHostCache.__init__, cache, 8, 1, 2, "routed_experts")
    out["unpinned_host_cache"] = {"ok": cache.buffer.is_pinned(), "detail": f"pinned: {cache.buffer.is_pinned()}"}

    from sglang_patches.cpu.fixes.cuda_synchronize import without_cuda_sync

    real = torch.cuda.synchronize
    seen = without_cuda_sync(lambda: torch.cuda.synchronize)
    out["cuda_synchronize"] = {"ok": seen is real, "detail": f"torch.cuda.synchronize untouched: {seen is real}"}

    from sglang_patches.cpu import site_hook

    site_hook._define_torchvision_ops()
    import torchvision.ops  # noqa: F401  (the real CUDA build registers its own nms)

    out["torchvision_ops"] = {"ok": not site_hook._TV_LIB and hasattr(torch.ops.torchvision, "nms"),
                              "detail": f"hook defined ops: {bool(site_hook._TV_LIB)}"}
    return out


if __name__ == "__main__":
    sys.path[:0] = [os.getcwd(), os.path.dirname(os.path.abspath(__file__))]
    print(json.dumps(run()))
