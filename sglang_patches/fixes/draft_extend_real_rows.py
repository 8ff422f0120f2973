"""Eager EAGLE draft extend under MLP-sync padding runs attention on its real rows only.

Defect: under DP attention `prepare_mlp_sync_batch` pads an eager DRAFT_EXTEND_V2 batch from
`bs * k` to a multiple of attn_tp_size, but its attention metadata was planned before the
padding and is not re-planned (`eagle_worker_common.prepare_for_draft_extend`). SGLang's
real-rows path for padded extends (`padded_extend_real_tokens`) excludes draft extend, so
the backend gets more query rows than planned (flashinfer: "q.shape[0] does not match
qo_indptr[-1]"; others compute garbage rows).

Fix: an AROUND hook on `padded_extend_real_tokens` also returns the real row count for an
eager DRAFT_EXTEND_V2 batch that was MLP-sync padded after a pre-pad plan covering exactly
its real rows, outside prefill-graph scope; SGLang's `_attention_on_real_rows` does the rest.

Up to 0.5.22 (no real-rows path, or 0.5.22's copy of it inside radix_attention) the hook is an
AROUND hook on `RadixAttention.forward` instead: the backend runs on the planned rows of such a batch (the plan
record of `mark_forward_metadata_ready`, made before the padding) and the output is padded back
with zeros.

Upstream: sglang#26016 (open), its second change.
"""
from sglang_patches.registry import Fix, Hook

from ._args import server_flag

TARGET = "sglang.srt.layers.attention.graph_utils.padded_extend_real_tokens"
RADIX_FORWARD = "sglang.srt.layers.radix_attention.RadixAttention.forward"


def _in_prefill_graph_scope() -> bool:
    from sglang.srt.model_executor.runner_utils import prefill_graph

    return prefill_graph.is_in_prefill_graph_scope()


def draft_extend_real_rows(original, q, forward_batch):
    real = original(q, forward_batch)
    if real is not None or not forward_batch.forward_mode.is_draft_extend_v2():
        return real
    real = forward_batch.global_num_token_non_padded_cpu
    if (
        forward_batch.global_num_tokens_padded_cpu is None  # no MLP-sync padding
        or real is None
        or forward_batch.forward_metadata_planned_num_tokens != real  # plan covers padded rows
        or not 0 < real < q.shape[0]
        or _in_prefill_graph_scope()  # a graph replay plans its own rows
    ):
        return None
    return real


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


REAL_ROWS = Hook(TARGET, draft_extend_real_rows)  # 0.5.23's real-rows path
PLANNED_ROWS = Hook(RADIX_FORWARD, attention_on_planned_rows)  # releases without it


def needed(server_args: dict) -> bool:
    return bool(server_flag(server_args, "enable_dp_attention", False) and server_flag(server_args, "speculative_algorithm"))


FIX = Fix(
    name="draft-extend-real-rows",
    family="dp-attention",
    defect=(
        "Eager EAGLE draft extend is padded for DP attention after its attention plan was made for the "
        "real rows, and SGLang's real-rows path skips draft extend. The attention backend sees more "
        "query rows than planned and crashes (flashinfer) or computes garbage."
    ),
    reference="sglang#26016",
    test="tests/test_dp_fixes.py::test_draft_extend_real_rows",
    needed=needed,
)
