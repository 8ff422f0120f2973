"""draft-extend-real-rows on 0.5.15.post1: there is no real-rows path (`padded_extend_real_tokens`,
`_attention_on_real_rows` are 0.5.23's), so an AROUND hook on `RadixAttention.forward` runs the
backend on an eager DRAFT_EXTEND_V2 batch's planned rows (the plan record of
`mark_forward_metadata_ready`, made before MLP-sync padding) and pads the output back with zeros.
"""


def planned_rows(q, forward_batch):
    """Rows the attention plan covers when an eager draft extend was padded after planning, else None."""
    from sglang.srt.layers import radix_attention as ra

    planned = getattr(forward_batch, "forward_metadata_planned_num_tokens", None)
    if (
        not forward_batch.forward_mode.is_draft_extend_v2()
        or not getattr(forward_batch, "forward_metadata_ready", False)
        or planned is None
        or not 0 < planned < q.shape[0]
        or ra.get_tc_piecewise_forward_context() is not None  # a graph replay plans its own rows
    ):
        return None
    return planned


def attention_on_planned_rows(original, self, q, k, v, forward_batch, *args, **kwargs):
    import torch

    real = planned_rows(q, forward_batch)
    if real is None:
        return original(self, q, k, v, forward_batch, *args, **kwargs)
    narrowed = {name: getattr(forward_batch, name) for name in ("out_cache_loc", "positions")}
    try:
        for name, value in narrowed.items():
            if value is not None:
                setattr(forward_batch, name, value[:real])
        out = original(self, q[:real], None if k is None else k[:real], None if v is None else v[:real],
                       forward_batch, *args, **kwargs)
    finally:
        for name, value in narrowed.items():
            setattr(forward_batch, name, value)
    pad = out.new_zeros((q.shape[0] - real, *out.shape[1:]))
    return torch.cat([out, pad])
