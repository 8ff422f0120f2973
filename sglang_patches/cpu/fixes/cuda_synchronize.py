"""CPU: the MTP/NextN draft model calls torch.cuda.synchronize() unguarded.

`Glm4MoeForCausalLM.set_embed_and_head` (called by the EAGLE worker to share the target's
embedding and lm_head with the draft model) ends with `torch.cuda.synchronize()`, which raises
"Torch not compiled with CUDA enabled" on a CPU-only torch: NEXTN cannot start.

Fix: AROUND `set_embed_and_head`: without CUDA, run it with `torch.cuda.synchronize` as a no-op
(nothing to synchronize); the original body runs unchanged.
"""
import threading

from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.models.glm4_moe.Glm4MoeForCausalLM.set_embed_and_head"
_lock = threading.Lock()


def _no_sync(*args, **kwargs):
    return None


def without_cuda_sync(original, *args, **kwargs):
    import torch

    if torch.cuda.is_available():
        return original(*args, **kwargs)
    with _lock:
        saved = torch.cuda.synchronize
        torch.cuda.synchronize = _no_sync
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.synchronize = saved


NO_SYNC = Hook(TARGET, without_cuda_sync, "around")

FIX = Fix(
    name="cpu-cuda-synchronize",
    family="cpu",
    defect=(
        "Glm4MoeForCausalLM.set_embed_and_head calls torch.cuda.synchronize() without checking for CUDA. "
        "NEXTN/EAGLE on a CPU engine crashes while the draft model takes over the target's lm_head."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-cuda-synchronize]",
    when=cpu_idle_reason,
)
