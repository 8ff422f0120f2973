"""Tokens/s of the real CPU engine with and without the DP-attention plugin; prints the ratio.

Same tiny model, same prompts, greedy; engines run one at a time in alternating order
(off, on, off, on, ...). Modes:
  dp-fixes (default): configuration (a) (routed experts, so the capturer hooks run on every
      forward) with the DP-attention fixes disabled (SLIME_MOE_ROLLOUT_DISABLE) vs enabled;
      the CPU fixes stay on in both, since routed experts cannot start on CPU without them.
  stock: a plain single-rank engine with SGLANG_PLUGINS=none vs our plugin loaded.
"""
import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout.engine_launch import EngineOptions, launch, preset  # noqa: E402
from rollout.tiny_model import build_tiny_glm  # noqa: E402

PROMPTS = [
    "the quick brown fox", "a mixture of experts", "data parallel attention", "rollout routing replay",
    "speculative decoding drafts tokens", "tiny models make tests fast", "hello world", "numbers like 0 1 2",
]


def dp_fix_names() -> list:
    from sglang_patches.registry import all_fixes

    return [f.name for f in all_fixes() if f.family == "dp-attention" and not f.upstream]


def options(mode: str, on: bool, model: str) -> EngineOptions:
    if mode == "stock":
        return EngineOptions(model_path=model, env={} if on else {"SGLANG_PLUGINS": "none"})
    env = {} if on else {"SLIME_MOE_ROLLOUT_DISABLE": ",".join(dp_fix_names())}
    return preset("a", model, env=env)


def one_run(opts, n_tokens: int, log: str) -> float:
    import requests

    eng = launch(opts, log)
    try:
        eng.wait_ready(600)
        body = lambda p: {"text": p, "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0,
                                                         "ignore_eos": True},
                          "return_routed_experts": bool(opts.routed_experts)}
        post = lambda p: requests.post(eng.url + "/generate", headers=eng.headers(), json=body(p), timeout=600).json()
        post(PROMPTS[0])  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            outs = list(ex.map(post, PROMPTS))
        dt = time.perf_counter() - t0
        return sum(o["meta_info"]["completion_tokens"] for o in outs) / dt
    finally:
        left = eng.stop()
        if left:
            raise RuntimeError(f"processes left after stop: {left}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("dp-fixes", "stock"), default="dp-fixes")
    ap.add_argument("--pairs", type=int, default=2, help="alternating off/on pairs (one engine start each)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.tokens < 1:
        print("error: --pairs and --tokens must be >= 1", file=sys.stderr)
        return 2
    model = build_tiny_glm(variant="random")
    logdir = os.path.join(os.path.dirname(model), "logs")
    rates = {False: [], True: []}
    for i in range(args.pairs):
        for on in (False, True):
            r = one_run(options(args.mode, on, model), args.tokens, os.path.join(logdir, f"bench-{args.mode}-{on}-{i}.log"))
            rates[on].append(r)
            print(f"pair {i + 1}/{args.pairs} plugin {'on ' if on else 'off'}: {r:.1f} tokens/s", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"mode {args.mode}: median tokens/s off {off:.1f}, on {on:.1f}; ratio on/off = {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
