"""The routed-experts device buffer has a row for every token a forward can capture.

Defect: `RoutedExpertsCapturer.__init__` sizes its device buffer as
`max(chunked_prefill_size, max_running_requests) * num_dp_ranks` (with a FIXME for
speculative verify tokens). It overflows ("The expanded size of the tensor ... must match")
when a prefill-graph bucket exceeds that, when EAGLE verify writes
`max_running_requests * num_draft_tokens` rows per rank, or when `chunked_prefill_size = -1`
makes the first term negative.

Fix: an AROUND hook lets SGLang build the capturer, then, if its buffer is short, swaps in a
device cache (SGLang's own `BaseDeviceCache`) of `rows_needed(...)` rows: per DP rank the
largest of the chunked-prefill size (or the context length when unchunked), the prefill-graph
buckets, and max-running-requests / decode-graph batch sizes times the draft-token count,
aligned to lcm(attn_tp_size, draft tokens), times the number of DP ranks.

Releases read the sizing inputs from different places: 0.5.18+ from the runtime context's config
bags (`grow_buffer` on 0.5.22+, `grow_buffer_dp_size` on 0.5.18-0.5.21), 0.5.16 and 0.5.17 from the
published ServerArgs (`grow_buffer_published_args`), 0.5.15.post1 from the global server args
(`grow_buffer_global_args`); the prefill-graph buckets are
`cuda_graph_config.prefill.bs` as given.

The same hook first refuses a capturer for speculative settings that draft a tree (EAGLE top-k > 1,
ngram), whose rows SGLang leaves behind (accepted-path-rows, sglang#37949).

Upstream: sglang#31116 (closed as inactive), sglang#26860.
"""
import math

from sglang_patches.registry import Fix, Hook

from ._args import bind, server_flag
from .accepted_path_rows import refuse_tree_capture

TARGET = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer.__init__"


def ceil_align(n: int, a: int) -> int:
    return -(-n // a) * a


def rows_needed(*, chunked_prefill_size, context_len, max_running_requests, num_dp_ranks,
                attn_tp_size, prefill_graph_tokens=(), decode_graph_bs=(), draft_tokens=None) -> int:
    """Device rows the DP-gathered capture buffer needs (all DP ranks together)."""
    k = draft_tokens or 1
    cps = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else context_len
    per_rank = max(
        cps,
        max(prefill_graph_tokens, default=0),
        max_running_requests * k,
        max(decode_graph_bs, default=0) * k,
    )
    align = math.lcm(attn_tp_size, k) if k > 1 else attn_tp_size
    return ceil_align(per_rank, align) * num_dp_ranks


def _graph_sizes():
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec

    cfg = get_exec().graph.cuda_graph_config
    prefill = cfg.prefill.bs if cfg.prefill.backend != Backend.DISABLED and cfg.prefill.bs else ()
    decode = cfg.decode.bs if cfg.decode.backend != Backend.DISABLED and cfg.decode.bs else ()
    return tuple(prefill), tuple(decode)


def _grow_from_bags(original, args, kwargs, num_dp_ranks):
    """Build the capturer as SGLang does, then grow a short buffer; the sizing inputs come from the
    runtime context's config bags, the DP width from `num_dp_ranks(parallel)`."""
    from sglang.srt import runtime_context
    from sglang.srt.state_capturer import routed_experts as re_mod

    spec = runtime_context.get_spec()
    refuse_tree_capture(spec.speculative_algorithm, getattr(spec, "speculative_eagle_topk", None))
    bound = bind(original, *args, **kwargs)
    original(*bound.args, **bound.kwargs)
    a = bound.arguments
    parallel = re_mod.get_parallel()
    schedule = re_mod.get_schedule()
    prefill_tokens, decode_bs = _graph_sizes()
    need = rows_needed(
        chunked_prefill_size=schedule.chunked_prefill_size,
        context_len=getattr(a["model_config"], "context_len", 0) or getattr(schedule, "max_prefill_tokens", 0),
        max_running_requests=a["max_running_requests"],
        num_dp_ranks=num_dp_ranks(parallel),
        attn_tp_size=parallel.attn_tp_size if re_mod.is_dp_attention_enabled() else 1,
        prefill_graph_tokens=prefill_tokens,
        decode_graph_bs=decode_bs,
        draft_tokens=runtime_context.max_speculative_num_draft_tokens(),
    )
    regrow(a["self"], need, a["device"])
    return None


def grow_buffer(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__ (0.5.22+: `ParallelContext.num_dp_ranks`)."""
    return _grow_from_bags(original, args, kwargs, lambda parallel: parallel.num_dp_ranks)


def grow_buffer_dp_size(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__ (0.5.18 ... 0.5.21: the DP width is `ParallelContext.dp_size`)."""
    return _grow_from_bags(original, args, kwargs, lambda parallel: parallel.dp_size)


def regrow(capturer, need: int, device) -> None:
    """Swap a capturer's device cache (and scattered-a2a gather buffer) for `need` rows if short."""
    import torch
    from sglang.srt.state_capturer import base

    old = capturer.device_cache
    old_rows = old.buffer.shape[0]
    if old_rows >= need:
        return
    capturer.device_cache = None
    del old.buffer  # free the short buffer before allocating the new one
    capturer.device_cache = base.BaseDeviceCache(need, old.num_layers, old.topk_size, device, name=old.name)
    gather = getattr(capturer, "gather_buffer", None)
    if gather is not None:  # scattered a2a backends: rows x attn_tp_size, as SGLang sizes it
        capturer.gather_buffer = torch.empty(
            (gather.shape[0] // old_rows * need, gather.shape[1]), dtype=gather.dtype, device=gather.device
        )


def _server_args_graph_sizes(server_args):
    from sglang.srt.model_executor.cuda_graph_config import Backend

    cfg = server_args.cuda_graph_config
    on = lambda phase: phase.backend != Backend.DISABLED and phase.bs  # noqa: E731
    return tuple(cfg.prefill.bs) if on(cfg.prefill) else (), tuple(cfg.decode.bs) if on(cfg.decode) else ()


def _server_args_draft_tokens(server_args):
    if not server_args.speculative_algorithm:
        return None
    return max(server_args.speculative_num_draft_tokens or 1,
               getattr(server_args, "max_speculative_num_draft_tokens", None) or 1)


def _grow_from_server_args(original, args, kwargs, server_args, attn_tp_size):
    """Build the capturer as SGLang does, then grow a short buffer; `server_args()` and
    `attn_tp_size()` read the release's published settings (`dp_size` is the DP width)."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    sa = server_args()
    refuse_tree_capture(sa.speculative_algorithm, getattr(sa, "speculative_eagle_topk", None))
    bound = bind(original, *args, **kwargs)
    original(*bound.args, **bound.kwargs)
    a = bound.arguments
    dp_attention = re_mod.is_dp_attention_enabled()
    prefill_tokens, decode_bs = _server_args_graph_sizes(sa)
    need = rows_needed(
        chunked_prefill_size=sa.chunked_prefill_size,
        context_len=getattr(a["model_config"], "context_len", 0),
        max_running_requests=a["max_running_requests"],
        num_dp_ranks=sa.dp_size if dp_attention else 1,
        attn_tp_size=attn_tp_size() if dp_attention else 1,
        prefill_graph_tokens=prefill_tokens,
        decode_graph_bs=decode_bs,
        draft_tokens=_server_args_draft_tokens(sa),
    )
    regrow(a["self"], need, a["device"])
    return None


def grow_buffer_global_args(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__ where it reads `get_global_server_args()` (0.5.15.post1)."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    return _grow_from_server_args(original, args, kwargs, lambda: re_mod.get_global_server_args(),
                                  lambda: re_mod.get_attention_tp_size())


def grow_buffer_published_args(original, *args, **kwargs):
    """AROUND RoutedExpertsCapturer.__init__ where it reads the runtime context's `get_server_args()` (0.5.16)."""
    from sglang.srt.state_capturer import routed_experts as re_mod

    return _grow_from_server_args(original, args, kwargs, lambda: re_mod.get_server_args(),
                                  lambda: re_mod.get_parallel().attn_tp_size)


GROW = Hook(TARGET, grow_buffer)
GROW_DP_SIZE = Hook(TARGET, grow_buffer_dp_size)
GROW_GLOBAL_ARGS = Hook(TARGET, grow_buffer_global_args)
GROW_PUBLISHED_ARGS = Hook(TARGET, grow_buffer_published_args)


def needed(server_args: dict) -> bool:
    return bool(server_flag(server_args, "enable_return_routed_experts", False))


FIX = Fix(
    name="routed-experts-rows",
    family="dp-attention",
    defect=(
        "The routed-experts device buffer ignores prefill-graph buckets, EAGLE verify tokens and "
        "chunked_prefill_size=-1, so capture overflows it under DP attention + speculative decoding. "
        "SGLang crashes at graph capture or at run time."
    ),
    reference="sglang#31116, sglang#26860",
    test="tests/test_dp_fixes.py::test_routed_experts_rows",
    needed=needed,
)
