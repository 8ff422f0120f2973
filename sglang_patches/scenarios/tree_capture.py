"""accepted-path-rows in the engine: SGLang's own `RoutedExpertsCapturer.__init__` under a speculative setting,
stock and with the plugin (routed-experts-rows' hook calls `accepted_path_rows.refuse_tree_capture`).

Run as `python -m sglang_patches.scenarios.tree_capture STATE` (runner); the release's driver sets up the context.
"""
import logging
import sys
from contextlib import ExitStack
from types import SimpleNamespace

from sglang_patches.scenarios.drivers import pick
from sglang_patches.scenarios.runner import main

REFUSED = "routed-expert capture refused"


def _build(topk: int) -> dict:
    import sglang.srt.state_capturer.routed_experts as re_mod

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("slime_moe_rollout").addHandler(handler)
    try:
        with ExitStack() as stack:
            driver = pick()
            driver.capturer_context(stack, cps=1024, num_dp=2, attn_tp=2, k=4, prefill_bs=None)
            spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=topk,
                        speculative_num_draft_tokens=4)
            if hasattr(re_mod, "get_global_server_args"):  # 0.5.15.post1: the driver's patched ServerArgs
                vars(re_mod.get_global_server_args()).update(spec)
            else:  # 0.5.16+: SGLang's own publication of a config (ServerArgs and its config bags)
                from sglang.srt import runtime_context as rc
                kept = {"cuda_graph_config": driver.graph_config()} if hasattr(driver, "graph_config") else {}
                stack.enter_context(rc.get_context().override_server_args(chunked_prefill_size=1024, **kept, **spec))
            model_config = SimpleNamespace(context_len=4096, hf_text_config=SimpleNamespace(
                num_experts_per_tok=8, num_hidden_layers=2))
            try:
                cap = re_mod.RoutedExpertsCapturer(model_config, num_tokens=64, max_running_requests=16,
                                                   num_fused_shared_experts=0, device="cpu")
            except ValueError as e:
                return {"refused": str(e), "log": [ln for ln in lines if REFUSED in ln]}
            return {"built": int(cap.device_cache.buffer.shape[0]), "log": [ln for ln in lines if REFUSED in ln]}
    finally:
        logging.getLogger("slime_moe_rollout").removeHandler(handler)


def tree_capture_topk2():
    got = _build(2)
    ok = REFUSED in got.get("refused", "") and len(got["log"]) == 1 and "sglang#37949" in got["log"][0]
    return {"ok": ok, "detail": got.get("refused") or f"EAGLE top-k 2: built a capturer of {got['built']} rows"}


def tree_capture_topk1():
    got = _build(1)
    return {"ok": "built" in got and not got["log"], "detail": str(got)}


SCENARIOS = {"tree_capture_topk2": tree_capture_topk2, "tree_capture_topk1": tree_capture_topk1}

if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
