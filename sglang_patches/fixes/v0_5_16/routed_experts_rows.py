"""routed-experts-rows on 0.5.16: the sizing inputs come from the published ServerArgs
(`runtime_context.get_server_args`, 0.5.15 reads `get_global_server_args`).

0.5.16 sizes the buffer `max(cps * dp_size, max_running_requests * dp_size)` with the per-rank
chunked-prefill size (FIXME: verify tokens); prefill-graph buckets are `cuda_graph_config.prefill.bs`
as given (the DP clamp skips a user-set `--cuda-graph-max-bs-prefill`).
"""
from sglang_patches.fixes.v0_5_15.routed_experts_rows import grow


def grow_buffer(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__ (0.5.16: the runtime context's server args)."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    return grow(original, args, kwargs, lambda: re_mod.get_server_args(),
                lambda: re_mod.get_parallel().attn_tp_size)
