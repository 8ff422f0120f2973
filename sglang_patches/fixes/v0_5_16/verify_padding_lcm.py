"""verify-padding-lcm on 0.5.16: the draft-token count comes from the published ServerArgs."""
from sglang_patches.fixes.v0_5_15.routed_experts_rows import draft_tokens
from sglang_patches.fixes.verify_padding_lcm import pad_counts


def align_to_whole_requests(self, *args, **kwargs):
    """BEFORE ForwardBatch.prepare_mlp_sync_batch (same shape as 0.5.23's hook)."""
    from sglang.srt.model_executor import forward_batch_info as fbi
    from sglang.srt.runtime_context import get_server_args

    pad_counts(self, fbi.get_parallel().attn_tp_size, draft_tokens(get_server_args()))
    return None
