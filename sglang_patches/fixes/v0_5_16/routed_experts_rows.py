"""routed-experts-rows on 0.5.16: the sizing inputs come from the published ServerArgs
(`runtime_context.get_server_args`, 0.5.15 reads `get_global_server_args`).

0.5.16 sizes the buffer `max(cps * dp_size, max_running_requests * dp_size)` with the per-rank
chunked-prefill size (FIXME: verify tokens); prefill-graph buckets are `cuda_graph_config.prefill.bs`
as given (the DP clamp skips a user-set `--cuda-graph-max-bs-prefill`).
"""
from sglang_patches.fixes._args import bind
from sglang_patches.fixes.routed_experts_rows import regrow, rows_needed
from sglang_patches.fixes.v0_5_15.routed_experts_rows import _graph_sizes, draft_tokens


def grow_buffer(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__: build as SGLang does, then grow a short buffer."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    bound = bind(original, *args, **kwargs)
    original(*bound.args, **bound.kwargs)
    a = bound.arguments
    sa = re_mod.get_server_args()
    dp_attention = re_mod.is_dp_attention_enabled()
    prefill_tokens, decode_bs = _graph_sizes(sa)
    need = rows_needed(
        chunked_prefill_size=sa.chunked_prefill_size,
        context_len=getattr(a["model_config"], "context_len", 0),
        max_running_requests=a["max_running_requests"],
        num_dp_ranks=sa.dp_size if dp_attention else 1,
        attn_tp_size=re_mod.get_parallel().attn_tp_size if dp_attention else 1,
        prefill_graph_tokens=prefill_tokens,
        decode_graph_bs=decode_bs,
        draft_tokens=draft_tokens(sa),
    )
    regrow(a["self"], need, a["device"])
    return None
