"""Per-call cost of each hooked SGLang function with and without our hook, side by side.

Loads the plugin through SGLang's own `load_plugins()`, then times every hooked target twice
on the same inputs: the hooked function and the original it wraps (`__wrapped__`), in
alternating rounds. Prints microseconds per call and the ratio hooked / original, each judged
against its target in benchmarks/targets.toml (key: the name up to the first space).

    .venv/bin/python benchmarks/hook_overhead.py [--rounds 7] [--calls 2000]   (best of the rounds per side)
"""
import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _targets import finish, judge  # noqa: E402


def per_call(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def cases():
    """(name, hooked_call, original_call) on representative inputs; the simulated context is
    the one the regression scenarios use."""
    from contextlib import ExitStack

    import torch

    from sglang.srt.layers.attention import graph_utils
    from sglang.srt.model_executor.cuda_graph_buffer_registry import CudaGraphBufferRegistry
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    from sglang_patches.fixes.capturer_extent import EXTENT_ATTR
    from sglang_patches.scenarios import dp as sc
    from sglang_patches.scenarios.drivers import pick

    out = []
    reg = CudaGraphBufferRegistry(device=torch.device("cpu"), max_bs=64, max_num_tokens=256)
    fb = SimpleNamespace()
    kw = dict(raw_bs=2, padded_bs=2, raw_num_tokens=8, padded_num_tokens=8)
    fill = CudaGraphBufferRegistry.fill_from
    out.append(("CudaGraphBufferRegistry.fill_from", lambda: fill(reg, fb, **kw),
                lambda: fill.__wrapped__(reg, fb, **kw)))

    stack = ExitStack()
    sc.API = sc.API or pick()
    sc.API.dp_context(stack, dp_rank=1, dp_size=2)
    cap = sc._capturer(rows=64)
    efb = SimpleNamespace(global_num_tokens_cpu=[4, 8], out_cache_loc=torch.arange(100, 108),
                          out_cache_loc_virtual=None)
    efb.__dict__[EXTENT_ATTR] = 8  # what the BEFORE hook on fill_from records for this replay
    end = BaseTopkCapturer.on_forward_end
    args = dict(forward_batch=efb, can_run_graph=True, cuda_graph_batch=2, no_copy_to_cpu=True)
    out.append(("BaseTopkCapturer.on_forward_end", lambda: end(cap, **args),
                lambda: end.__wrapped__(cap, **dict(args, cuda_graph_batch=8))))

    q = torch.empty(8, 2, 4)
    dfb = sc.API.draft_extend_batch(real=4, padded=8, planned=4)
    pert = graph_utils.padded_extend_real_tokens
    out.append(("padded_extend_real_tokens", lambda: pert(q, dfb), lambda: pert.__wrapped__(q, dfb)))

    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    prep = ForwardBatch.prepare_mlp_sync_batch

    def run_prepare(fn):
        with mock.patch.object(ForwardBatch, "prepare_mlp_sync_batch", fn):
            sc._prepare(bs=1, k=3, attn_tp=8)

    out.append(("ForwardBatch.prepare_mlp_sync_batch (+ batch setup)", lambda: run_prepare(prep),
                lambda: run_prepare(prep.__wrapped__)))

    def build(fn):
        from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

        with mock.patch.object(RoutedExpertsCapturer, "__init__", fn):
            sc._rows_case(64, cps=256, mrr=64, num_dp=2, attn_tp=2)

    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    init = RoutedExpertsCapturer.__init__
    out.append(("RoutedExpertsCapturer.__init__ (start-up, + setup)", lambda: build(init),
                lambda: build(init.__wrapped__)))

    from sglang.srt.layers.moe import topk

    # every MoE layer of every eager forward: 64 tokens, top-8 of 64 experts, no retracted request in the batch
    logits = torch.randn(64, 64)
    ids, weights = logits.topk(8, -1)
    post = dict(topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=topk.TopKConfig(top_k=8),
                router_logits=logits, layer_id=1)
    pp = topk._post_process_topk_ids
    out.append(("topk._post_process_topk_ids", lambda: pp(**post), lambda: pp.__wrapped__(**post)))
    return out, stack


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_patches import plugin

    if not plugin._registered:
        sys.exit("error: the plugin registered no hooks (is SGLANG_PLUGINS excluding it?)")
    rows, stack = cases()
    print(f"{'hooked target':<52} {'orig us':>9} {'hooked us':>10} {'ratio':>7}")
    with stack:
        for name, hooked, orig in rows:
            calls = args.calls if "setup" not in name else max(20, args.calls // 50)
            a, b = [], []
            for _ in range(args.rounds):  # alternate to share the machine's noise
                a.append(per_call(orig, calls))
                b.append(per_call(hooked, calls))
            o, h = min(a), min(b)  # best of the rounds: the least disturbed, as timeit advises
            print(f"{name:<52} {o:9.2f} {h:10.2f} {h / o:7.2f}")
            judge("hook_overhead", name.split(" ")[0], h / o)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
