"""verify-padding-lcm on 0.5.15.post1: the draft-token count comes from the global server args."""
from sglang_patches.fixes.verify_padding_lcm import pad_counts

from .routed_experts_rows import draft_tokens


def align_to_whole_requests(self, *args, **kwargs):
    from sglang.srt.model_executor import forward_batch_info as fbi
    from sglang.srt.server_args import get_global_server_args

    pad_counts(self, fbi.get_parallel().attn_tp_size, draft_tokens(get_global_server_args()))
    return None
