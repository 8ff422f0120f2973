"""draft-extend-real-rows on 0.5.16: run eager draft-extend attention on the planned rows.

0.5.16 plans an eager DRAFT_EXTEND_V2 batch in `eagle_worker_common.prepare_for_draft_extend`
and marks it ready without `replan_equivalent`, so `_forward_raw` never re-plans after
`prepare_mlp_sync_batch` pads it to attn_tp; `RadixAttention.forward` has no real-rows path.
The AROUND hook on `RadixAttention.forward` hands the backend the planned (real) rows with the
cache locations and positions narrowed for the call, and pads the output back with zero rows.
"""
from sglang_patches.fixes._args import bind


def planned_real_rows(q, forward_batch):
    """Rows the pre-pad plan covers when an eager draft extend was padded after it, else None."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_draft_extend_v2():
        return None
    if not forward_batch.forward_metadata_ready or forward_batch.forward_metadata_replan_equivalent:
        return None  # planned by the forward path itself, after the padding
    planned = forward_batch.forward_metadata_planned_num_tokens
    if forward_batch.global_num_tokens_cpu is None or not 0 < planned < q.shape[0]:
        return None  # no MLP-sync padding, or a plan covering every row
    if forward_batch.out_cache_loc.shape[0] != q.shape[0] or getattr(forward_batch, "mha_return_lse", False):
        return None  # not the live padded batch (a graph's static view), or a (out, lse) result
    return planned


def draft_extend_real_rows(original, *args, **kwargs):
    bound = bind(original, *args, **kwargs)
    a = bound.arguments
    fb, q = a["forward_batch"], a["q"]
    real = planned_real_rows(q, fb)
    if real is None:
        return original(*bound.args, **bound.kwargs)
    rows = q.shape[0]
    for name in ("q", "k", "v"):
        if a[name] is not None and a[name].shape[0] == rows:
            a[name] = a[name][:real]
    for name, t in list(a["kwargs"].items()):
        if hasattr(t, "shape") and t.dim() and t.shape[0] == rows:
            a["kwargs"][name] = t[:real]
    out_cache_loc, positions = fb.out_cache_loc, fb.positions
    fb.out_cache_loc, fb.positions = out_cache_loc[:real], positions[:real]
    try:
        out = original(*bound.args, **bound.kwargs)
    finally:
        fb.out_cache_loc, fb.positions = out_cache_loc, positions
    import torch

    return torch.cat([out, out.new_zeros((rows - real,) + tuple(out.shape[1:]))])
