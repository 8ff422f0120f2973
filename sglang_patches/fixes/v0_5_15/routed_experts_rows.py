"""routed-experts-rows on 0.5.15.post1: the sizing inputs come from the global server args
(no runtime context); the prefill-graph buckets are `cuda_graph_config.prefill.bs` as given."""
from sglang_patches.fixes._args import bind
from sglang_patches.fixes.routed_experts_rows import regrow, rows_needed


def _graph_sizes(server_args):
    from sglang.srt.model_executor.cuda_graph_config import Backend

    cfg = server_args.cuda_graph_config
    on = lambda phase: phase.backend != Backend.DISABLED and phase.bs  # noqa: E731
    return tuple(cfg.prefill.bs) if on(cfg.prefill) else (), tuple(cfg.decode.bs) if on(cfg.decode) else ()


def draft_tokens(server_args):
    if not server_args.speculative_algorithm:
        return None
    return max(server_args.speculative_num_draft_tokens or 1,
               getattr(server_args, "max_speculative_num_draft_tokens", None) or 1)


def grow(original, args, kwargs, server_args, attn_tp_size):
    """Build the capturer as SGLang does, then grow a short buffer; `server_args()` and
    `attn_tp_size()` read this version's published settings."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    bound = bind(original, *args, **kwargs)
    original(*bound.args, **bound.kwargs)
    a = bound.arguments
    sa = server_args()
    dp_attention = re_mod.is_dp_attention_enabled()
    prefill_tokens, decode_bs = _graph_sizes(sa)
    need = rows_needed(
        chunked_prefill_size=sa.chunked_prefill_size,
        context_len=getattr(a["model_config"], "context_len", 0),
        max_running_requests=a["max_running_requests"],
        num_dp_ranks=sa.dp_size if dp_attention else 1,
        attn_tp_size=attn_tp_size() if dp_attention else 1,
        prefill_graph_tokens=prefill_tokens,
        decode_graph_bs=decode_bs,
        draft_tokens=draft_tokens(sa),
    )
    regrow(a["self"], need, a["device"])
    return None


def grow_buffer(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__ (0.5.15.post1: global server args)."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    return grow(original, args, kwargs, lambda: re_mod.get_global_server_args(),
                lambda: re_mod.get_attention_tp_size())
