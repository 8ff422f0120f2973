"""Routed-expert capture gets the padded per-DP-rank extent of the runner that actually ran.

Defect: `ModelRunner.forward` passes `getattr(decode_cuda_graph_runner, "bs", None)` to the
state capturers whatever runner executed, in request units. Under DP attention (non-scattered
a2a backend) a prefill-graph replay then crashes on `dp_rank * None` (before any decode replay)
or slices with a stale decode `bs`, and an EAGLE-verify graph replay slices DP ranks > 0 with
stride `bs` instead of `bs * num_draft_tokens`: routed experts come back silently wrong.

Fix: the graph runners hand their padded token count (`padded_num_tokens`) to
`CudaGraphBufferRegistry.fill_from`, which is exactly the per-rank stride of the DP-gathered
buffer; a BEFORE hook records it on the forward batch, and an AROUND hook on
`BaseTopkCapturer.on_forward_end` passes that extent (token units) when a graph ran and None
on the eager / split-prefill path (prefix-sum layout).

Upstream: sglang#31100 (open), sglang#30712.
"""
from sglang_patches.registry import Fix, Hook

from ._args import bind

EXTENT_ATTR = "slime_moe_rollout_graph_extent"
FILL_FROM = "sglang.srt.model_executor.cuda_graph_buffer_registry.CudaGraphBufferRegistry.fill_from"
ON_FORWARD_END = "sglang.srt.state_capturer.base.BaseTopkCapturer.on_forward_end"


def record_extent(self, forward_batch, *args, **kwargs):
    """BEFORE fill_from: remember the padded per-rank token count this replay uses."""
    padded = kwargs.get("padded_num_tokens")
    if padded is not None and forward_batch is not None:
        setattr(forward_batch, EXTENT_ATTR, int(padded))
    return None


def use_executed_extent(original, *args, **kwargs):
    """AROUND on_forward_end: replace the decode runner's `bs` with the executed extent."""
    if len(args) == 1 and "can_run_graph" in kwargs:  # ModelRunner.forward's keyword call
        a = kwargs
    else:
        bound = bind(original, *args, **kwargs)
        args, a = bound.args[:1], dict(list(bound.arguments.items())[1:])
    if a["can_run_graph"]:
        extent = getattr(a["forward_batch"], EXTENT_ATTR, None)
        if extent is not None:
            a["cuda_graph_batch"] = extent
        # No record: a runner that does not go through the buffer registry (e.g. the CPU
        # graph runner); keep SGLang's own value for it.
    else:
        a["cuda_graph_batch"] = None
    return original(*args, **a)


RECORD_EXTENT = Hook(FILL_FROM, record_extent, "before")
EXECUTED_EXTENT = Hook(ON_FORWARD_END, use_executed_extent)


def needed(server_args: dict) -> bool:
    a2a = server_args.get("moe_a2a_backend") or "none"
    return bool(
        server_args.get("enable_dp_attention")
        and server_args.get("enable_return_routed_experts")
        and a2a not in ("deepep", "deepep_v2")
    )


FIX = Fix(
    name="capturer-extent",
    family="dp-attention",
    defect=(
        "State capturers are handed the decode graph runner's request count whatever runner ran, so "
        "prefill-graph replays crash (None) or use a stale value, and EAGLE-verify replays slice DP "
        "ranks > 0 with a request stride instead of a token stride. Routed experts are wrong or crash."
    ),
    reference="sglang#31100, sglang#30712",
    test="tests/test_dp_fixes.py::test_capturer_extent",
    needed=needed,
)
