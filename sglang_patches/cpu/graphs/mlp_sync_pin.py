"""CPU graphs: a DP-attention batch's token counts go through pinned memory (up to 0.5.18; ported to 0.5.15.post1).

`ForwardBatch.prepare_mlp_sync_batch` (0.5.15.post1 forward_batch_info.py :1267) stages the DP ranks'
token counts in `torch.tensor(global_num_tokens, pin_memory=True)` on every device; a CPU-only torch has
no pinned allocator ("pin_memory=True requires a CUDA or other accelerator backend"), so the first
eager DP-attention forward (the readiness probe, an idle rank beside a replaying one) kills the
scheduler. 0.5.19 pins only where `is_pin_memory_available`. On 0.5.15.post1 the only CPU DP-attention
engine that gets that far is configuration (c) without NEXTN and with CPU graphs on (with NEXTN the KV
pool's Triton warm-up stops it first), so the fix is one of the graph-replay fixes.

Fix: AROUND `prepare_mlp_sync_batch`: without CUDA, run it with `torch.tensor` dropping `pin_memory`
(there is nothing to pin); the original body runs unchanged.
"""
import threading

from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch"
_lock = threading.Lock()


def unpinned(tensor_fn):
    def tensor(*args, pin_memory=False, **kwargs):
        return tensor_fn(*args, **kwargs)

    return tensor


def without_pinning(original, *args, **kwargs):
    import torch

    if not graphs_on() or torch.cuda.is_available():
        return original(*args, **kwargs)
    with _lock:
        saved = torch.tensor
        torch.tensor = unpinned(saved)
        try:
            return original(*args, **kwargs)
        finally:
            torch.tensor = saved


NO_PIN = Hook(TARGET, without_pinning, "around")

FIX = Fix(
    name="cpu-graphs-mlp-sync-pin",
    family="cpu",
    defect=(
        "prepare_mlp_sync_batch stages the DP ranks' token counts in pinned memory on every device. "
        "A CPU-only torch has no pinned allocator, so the first eager DP-attention forward kills the scheduler."
    ),
    reference="found running configuration (c) without NEXTN on CPU (SGLang 0.5.15.post1)",
    test="tests/test_engine_versions.py::test_c_no_nextn_without_mlp_sync_pin_dies_at_first_forward",
    when=graphs_idle_reason,
)
