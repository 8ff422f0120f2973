"""CPU: the native MoE path cannot take EP-local expert ids of -1.

With expert parallelism, experts that live on another rank arrive in `topk_ids` as -1. The CPU
MoE path `moe_forward_native` counts tokens per expert with `scatter_` over those ids, which
raises "index -1 is out of bounds"; mapping -1 to one fixed expert is wrong too, because
duplicate ids in a row collapse in that `scatter_` and the token/expert shapes diverge.

Fix: AROUND `moe_forward_native`: give every -1 slot a local expert that does not already
occur in that token's row, with weight 0, so the rows stay duplicate-free and the extra
experts contribute nothing. Needs top-k <= local experts (else a one-line error).
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.layers.moe.fused_moe_native.moe_forward_native"


def fill_remote_slots(topk_weights, topk_ids, num_local: int):
    """(weights, ids) with each -1 replaced by an unused local expert id and weight 0."""
    import torch

    missing = topk_ids < 0
    if not bool(missing.any()):
        return topk_weights, topk_ids
    if topk_ids.shape[1] > num_local:
        raise RuntimeError(f"cpu-ep-native-moe: top-k {topk_ids.shape[1]} exceeds the {num_local} "
                           "local experts of this EP rank; cannot fill remote slots without duplicates")
    ids = topk_ids.to(torch.int64)
    used = torch.zeros(ids.shape[0], num_local + 1, dtype=torch.int8, device=ids.device)
    used.scatter_(1, torch.where(missing, num_local, ids), 1)  # column num_local absorbs the -1s
    # Unused local experts first, in id order, per row.
    free = torch.argsort(used[:, :num_local], dim=1, stable=True)
    nth = torch.cumsum(missing.to(torch.int64), dim=1) - 1
    fill = torch.gather(free, 1, nth.clamp(min=0))
    new_ids = torch.where(missing, fill, ids).to(topk_ids.dtype)
    new_weights = torch.where(missing, torch.zeros_like(topk_weights), topk_weights)
    return new_weights, new_ids


def ep_local_ids(original, layer, x, topk_output, *args, **kwargs):
    weights, ids = topk_output[0], topk_output[1]
    new_w, new_ids = fill_remote_slots(weights, ids, int(layer.w13_weight.shape[0]))
    if new_ids is not ids:
        topk_output = topk_output._replace(topk_weights=new_w, topk_ids=new_ids)
    return original(layer, x, topk_output, *args, **kwargs)


LOCAL_IDS = Hook(TARGET, ep_local_ids, "around")

FIX = Fix(
    name="cpu-ep-native-moe",
    family="cpu",
    defect=(
        "Under expert parallelism non-local experts arrive as id -1, which the CPU MoE path "
        "moe_forward_native cannot index. Every EP run on CPU crashes in its first MoE layer."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-ep-native-moe]",
    when=cpu_idle_reason,
)
