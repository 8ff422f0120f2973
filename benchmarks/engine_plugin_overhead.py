"""Tokens/s of the real CPU engine with and without the DP-attention plugin; prints the ratio.

Same tiny model, same prompts, greedy; engines run one at a time in alternating order
(off, on, off, on, ...). Modes:
  dp-fixes (default): configuration (a) (routed experts, so the capturer hooks run on every
      forward) with the DP-attention fixes disabled (SLIME_MOE_ROLLOUT_DISABLE) vs enabled;
      the CPU fixes stay on in both, since routed experts cannot start on CPU without them.
  stock: a plain single-rank engine with SGLANG_PLUGINS=none vs our plugin loaded.
Judged (benchmarks/targets.toml): tokens per engine CPU-second, on / off (less sensitive than wall
time to other load on a shared machine).
"""
import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _targets import finish, judge  # noqa: E402

from rollout import config as rconfig  # noqa: E402
from rollout.net import auth_headers, free_port  # noqa: E402
from rollout.models.tiny import build_tiny_glm  # noqa: E402

PROMPTS = [
    "the quick brown fox", "a mixture of experts", "data parallel attention", "rollout routing replay",
    "speculative decoding drafts tokens", "tiny models make tests fast", "hello world", "numbers like 0 1 2",
]


def dp_fix_names() -> list:
    from sglang_patches.registry import all_fixes, detect, judge
    from sglang_patches.states import FixState

    here = detect()  # the fixes that hook this release
    return [f.name for f in all_fixes() if f.family == "dp-attention" and judge(f, here).state is FixState.ACTIVE]


def engine_spec(mode: str, on: bool, model: str):
    """Preset a (routed experts) for dp-fixes; the same engine without routed experts for stock."""
    cfg = rconfig.load("a")
    g = cfg.engine_groups[0]
    if mode == "stock":
        g.routed_experts = False
        g.env.update({} if on else {"SGLANG_PLUGINS": "none"})
    elif not on:
        g.env["SLIME_MOE_ROLLOUT_DISABLE"] = ",".join(dp_fix_names())
    return rconfig.engine_specs(cfg, model, ports=[free_port()])[0]


def tree_cpu_seconds(eng) -> float:
    import psutil

    total = 0.0
    for pid in eng.tree_pids():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_run(spec, n_tokens: int, batches: int, log_dir: str) -> tuple:
    """(tokens per wall second, tokens per engine CPU second), medians over `batches` batches
    of all prompts at once. CPU seconds of the engine's process tree are what the plugin's hooks
    cost; they are far less sensitive than wall time to other load on a shared machine."""
    import requests

    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.process import alive_pids
    from rollout.engines.readiness import start_ready
    from training_configs.schema import ReadinessBudgets

    eng, _ = start_ready(LocalBackend(log_dir), spec, ReadinessBudgets())
    tree = eng.tree_pids()
    try:
        body = lambda p: {"text": p, "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0,
                                                         "ignore_eos": True},
                          "return_routed_experts": spec.group.routed_experts}
        post = lambda p: requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), json=body(p),
                                       timeout=600).json()
        post(PROMPTS[0])  # warm-up
        wall, cpu = [], []
        for _ in range(batches):
            t0, c0 = time.perf_counter(), tree_cpu_seconds(eng)
            with ThreadPoolExecutor(len(PROMPTS)) as ex:
                outs = list(ex.map(post, PROMPTS))
            n = sum(o["meta_info"]["completion_tokens"] for o in outs)
            wall.append(n / (time.perf_counter() - t0))
            cpu.append(n / max(tree_cpu_seconds(eng) - c0, 1e-9))
        return statistics.median(wall), statistics.median(cpu)
    finally:
        eng.stop()
        left = alive_pids(tree)
        if left:
            raise RuntimeError(f"processes left after stop: {left}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("dp-fixes", "stock"), default="dp-fixes")
    ap.add_argument("--pairs", type=int, default=3, help="alternating off/on pairs (one engine start each)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--batches", type=int, default=3, help="timed batches per engine start")
    args = ap.parse_args(argv)
    if min(args.pairs, args.tokens, args.batches) < 1:
        print("error: --pairs, --tokens and --batches must be >= 1", file=sys.stderr)
        return 2
    model = build_tiny_glm(variant="random")
    logdir = os.path.join(os.path.dirname(model), "logs")
    rates = {False: [], True: []}
    cpu_rates = {False: [], True: []}
    for i in range(args.pairs):
        for on in (False, True):
            r, c = one_run(engine_spec(args.mode, on, model), args.tokens, args.batches,
                           os.path.join(logdir, f"bench-{args.mode}-{on}-{i}"))
            rates[on].append(r)
            cpu_rates[on].append(c)
            print(f"pair {i + 1}/{args.pairs} plugin {'on ' if on else 'off'}: {r:.1f} tokens/s, "
                  f"{c:.1f} tokens per engine CPU-second", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"mode {args.mode}: median tokens/s off {off:.1f}, on {on:.1f}; ratio on/off = {on / off:.3f} "
          f"(spread off {min(rates[False]):.0f}-{max(rates[False]):.0f}, on {min(rates[True]):.0f}-{max(rates[True]):.0f})")
    boff, bon = max(rates[False]), max(rates[True])
    print(f"mode {args.mode}: best tokens/s off {boff:.1f}, on {bon:.1f}; ratio on/off = {bon / boff:.3f} "
          "(best-of is the least disturbed run on a shared machine)")
    coff, con = statistics.median(cpu_rates[False]), statistics.median(cpu_rates[True])
    print(f"mode {args.mode}: median tokens per engine CPU-second off {coff:.1f}, on {con:.1f}; "
          f"ratio on/off = {con / coff:.3f}")
    judge("engine_plugin_overhead", "cpu_tokens", con / coff)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
