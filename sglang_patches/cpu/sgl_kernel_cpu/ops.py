"""Torch implementations of the `sgl_kernel` CPU ops SGLang 0.5.23 calls, by name."""
import functools
import sys

from .attention import decode_attention_cpu, extend_attention_cpu
from .cache_ops import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    copy_all_layer_kv_cache_cpu,
)
from .spec_ops import (
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

OPS = {
    fn.__name__: fn
    for fn in (
        copy_all_layer_kv_cache_cpu,
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        build_draft_decode_metadata_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
        extend_attention_cpu,
        decode_attention_cpu,
    )
}


def trace_first_calls(table=None) -> None:
    """Diagnostics (env SGL_KERNEL_CPU_TRACE=1): print each op's name to stderr on its first call.
    `table`: a {name: op} dict to wrap in place (default: OPS)."""
    table = OPS if table is None else table
    for name, fn in list(table.items()):
        if getattr(fn, "_traced", False):
            continue

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, _name=name, _seen=[], **kwargs):
            if not _seen:
                _seen.append(1)
                print(f"sgl_kernel CPU substitute: first call of {_name}", file=sys.stderr, flush=True)
            return _fn(*args, **kwargs)

        wrapper._traced = True
        table[name] = wrapper
