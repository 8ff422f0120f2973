"""Group placement vs today's per-sample routing on real engines: two engines of the DP-attention
miniature (training_configs/tiny-cpu-dpattn.yaml: dp 2, NEXTN, routed experts; chunk 4,096 so a batch
can hold several prompts), groups of 8, prompts of 256 tokens, the same engines for both arms (the
dispatcher's placement switched off for `today`), caches flushed before each arm, arms alternated.

    flock /tmp/engine.lock python benchmarks/group_placement_engines.py [--rounds 2] [--engine-groups 4]

Printed and judged: prompt tokens prefilled per group / prompt tokens (`prompt_tokens - cached_tokens`
of every answer, the primers included), placement / today; rollout tokens/s, placement / today;
samples per (engine, DP rank). slime's own generate_rollout through its router is not run here.
"""
import argparse
import asyncio
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _targets import fact, finish, judge  # noqa: E402

BENCH = "group_placement_engines"


class _Sink:
    async def put(self, group):
        return True


def _engine_config(args):
    from rollout import config as rconfig
    from rollout.cli.engine import model_for

    cfg = rconfig.load("c")   # training_configs/tiny-cpu-dpattn.yaml
    g = cfg.engine_groups[0]
    g.engines, g.chunked_prefill_size, g.max_running_requests = 2, 4096, 16
    r = cfg.rollout
    r.n_samples_per_prompt, r.concurrency_per_engine, r.sampling.max_new_tokens = 8, 16, args.engine_new_tokens
    for k in ("http_s", "server_up_s", "health_generate_s", "dp_probe_s"):
        setattr(r.budgets, k, 900.0)
    r.health.timeout_s, r.health.failures = 60.0, 10
    return cfg, model_for(cfg, ROOT)


async def _flush(mgr, budget_s: float = 120.0):
    """Empty every engine's prefix cache; SGLang refuses (HTTP 400) while requests are pending: retry."""
    from rollout.errors import EngineRejected

    end = time.monotonic() + budget_s
    for eng in mgr.source.engines.values():
        while True:
            try:
                await mgr.client.flush_cache(eng)
                break
            except EngineRejected as e:
                if time.monotonic() > end:
                    raise RuntimeError(f"{eng.name}: /flush_cache kept answering {e.status} for {budget_s:g} s")
            await asyncio.sleep(0.5)


async def _engine_arm(mgr, placement, groups, prompt_len, seed):
    await _flush(mgr)
    mgr.dispatcher.placement = placement
    primed0 = placement.primer_prefilled if placement else 0
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 300) for _ in range(prompt_len)] for _ in range(groups)]
    todo = [mgr.new_group(p) for p in prompts]
    t0 = time.monotonic()
    res = await mgr.rollout(todo, _Sink())
    wall = time.monotonic() - t0
    metas = [m for g in todo for s in g.samples for _, _, m in s.outputs]
    prefilled = sum(int(m["prompt_tokens"]) - int(m["cached_tokens"]) for m in metas)
    prefilled += (placement.primer_prefilled - primed0) if placement else 0
    tokens = sum(len(s.response_ids) for g in todo for s in g.samples)
    ranks = {}
    for g in todo:
        for s in g.samples:
            key = f"{s.engine}/{s.outputs[-1][2].get('dp_rank')}"
            ranks[key] = ranks.get(key, 0) + 1
    assert res.delivered == groups and res.failed_samples == 0, res
    return prefilled / (groups * prompt_len), tokens / wall, dict(sorted(ranks.items()))


def engines_part(args) -> None:
    from _tiny import started_manager

    cfg, model = _engine_config(args)
    print(f"{BENCH}: real engines: 2 x tiny-cpu-dpattn (dp 2, NEXTN, chunk 4096), {args.engine_groups} groups x 8, "
          f"{args.prompt_len}-token prompts, {args.engine_new_tokens} new tokens; starting...", flush=True)
    res = {}

    async def run():
        mgr = await started_manager(cfg, model, "group-placement-")
        try:
            mgr.dispatcher.keep_answers = True
            placement = mgr.dispatcher.placement
            for warm, seed in ((placement, 7), (None, 8)):   # warm-up of both arms' batch shapes, not counted
                await _engine_arm(mgr, warm, args.engine_groups, args.prompt_len, seed=seed)
            for r in range(args.rounds):
                for arm in (("placement", "today") if r % 2 == 0 else ("today", "placement")):
                    out = await _engine_arm(mgr, placement if arm == "placement" else None, args.engine_groups,
                                            args.prompt_len, seed=100 + 10 * r + (arm == "today"))
                    res.setdefault(arm, []).append(out)
                    print(f"  {arm:9s} round {r}: prefilled/prompt {out[0]:.3f}, {out[1]:.1f} tokens/s, "
                          f"samples per engine/rank {out[2]}", flush=True)
        finally:
            await mgr.stop()
    asyncio.run(run())
    mean = lambda arm, i: sum(x[i] for x in res[arm]) / len(res[arm])  # noqa: E731
    judge(BENCH, "engine_prefill", mean("placement", 0))
    judge(BENCH, "engine_prefill_vs_today", mean("placement", 0) / mean("today", 0))
    judge(BENCH, "engine_tokens_per_s", mean("placement", 1) / mean("today", 1))
    fact(BENCH, "slime's own generate_rollout on these engines: not run by this benchmark")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-groups", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--engine-new-tokens", type=int, default=8)
    engines_part(ap.parse_args())
    return finish()


if __name__ == "__main__":
    sys.exit(main())
