"""Group placement vs today's per-sample routing on real engines: two engines of the DP-attention
miniature (training_configs/tiny-cpu-dpattn.yaml: dp 2, NEXTN, routed experts; chunk 4,096 so a batch
can hold several prompts, a 16,384-token pool per rank), groups of 8 of an RL-like step (`rl_groups`:
prompts of 128-1,024 tokens behind a shared 64-token system prefix; per-sample budgets, most between
`--engine-new-tokens` / 2 and `--engine-new-tokens`, one in 8 8-16x that, generated to the last token:
ignore_eos), 12 groups per arm (3 per rank at 16 per engine), the same engines for both arms (the
dispatcher's placement switched off for `today`), caches flushed before each arm, arms alternated; in a
round every arm runs the same step (prompt lengths and budgets) with prompts of its own tokens.
With a slime checkout (SLIME_SRC or --slime-src) and slime's client Python (SLIME_PYTHON), a third arm:
slime's own generate_rollout through slime's router on the same engines (benchmarks/_slime_arm.py: a
worker under SLIME_PYTHON, the same prompts as token ids and the same per-sample budgets through a
stand-in data source, n and concurrency per engine as here); its prompt and cached tokens are those
slime's Sample keeps from each answer's meta_info (`prefix_cache_info`), its time is that of the
generate_rollout call. Without them that arm prints one line saying it was skipped and why.

    flock /tmp/engine.lock python benchmarks/group_placement_engines.py [--rounds 2] [--engine-groups 12]

Printed and judged: prompt tokens prefilled / prompt tokens (`prompt_tokens - cached_tokens` of every
answer, the primers included), placement / today, placement / slime; rollout tokens/s, placement /
today, placement / slime; DP-rank work imbalance (max / mean over ranks of the tokens each prefilled or
generated, from the answers' `dp_rank`; not for slime's arm: its Sample keeps no DP rank), today's as a
fact; samples per (engine, DP rank).
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
from _slime_arm import unavailable  # noqa: E402
from _targets import fact, finish, judge  # noqa: E402

BENCH = "group_placement_engines"
PREFIX_LEN = 64     # the shared system prompt


class _Sink:
    async def put(self, group):
        return True


def _engine_config(args):
    from rollout import config as rconfig
    from rollout.cli.engine import model_for

    cfg = rconfig.load("c")   # training_configs/tiny-cpu-dpattn.yaml
    g = cfg.engine_groups[0]
    g.engines, g.chunked_prefill_size, g.max_running_requests = 2, 4096, 16
    g.extra_sglang_args["max_total_tokens"] = 16384   # a rank holds its groups' prompts (a GPU pool would)
    r = cfg.rollout
    r.n_samples_per_prompt, r.concurrency_per_engine = 8, 16
    r.sampling.max_new_tokens = args.engine_new_tokens * 16     # the longest budget; each sample has its own
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


def rl_groups(groups, n, seed, short, vocab=300, lengths=(128, 1024), prefix_len=PREFIX_LEN, tail=(1, 8),
              tokens_seed=None):
    """An RL-like step: `groups` prompts of a shared system prefix (`prefix_len` tokens, the same in every
    step) and a question of `lengths` tokens, each with n response budgets from a long tail: most between
    short / 2 and short, one in `tail[1]` 8-16x `short` (the long reasoning chains). -> [(prompt, budgets)].
    `seed` draws the lengths and budgets, `tokens_seed` (default `seed`) the questions' tokens: arms of one
    round get the same step with prompts of their own (no arm finds another's prompts cached)."""
    rng, words = random.Random(seed), random.Random(seed if tokens_seed is None else tokens_seed)
    system = [random.Random(0).randrange(3, vocab) for _ in range(prefix_len)]
    out = []
    for _ in range(groups):
        question = [words.randrange(3, vocab) for _ in range(rng.randint(*lengths) - prefix_len)]
        budgets = [short * rng.randint(8, 16) if rng.randrange(tail[1]) < tail[0]
                   else rng.randint(max(1, short // 2), short) for _ in range(n)]
        out.append((system + question, budgets))
    return out


def _rank_work(metas, primers) -> float:
    """max / mean over DP ranks of the tokens each prefilled or generated (answers + primers)."""
    work = dict(primers)
    for eng, m in metas:
        key = (eng, m.get("dp_rank"))
        work[key] = work.get(key, 0) + int(m["prompt_tokens"]) - int(m["cached_tokens"]) + int(m["completion_tokens"])
    return max(work.values()) / (sum(work.values()) / len(work))


async def _slime_arm(mgr, slime, groups, args, seed, words):
    """slime's own generate_rollout on the same engines: (prefilled / prompt tokens, tokens/s, None, {})."""
    await _flush(mgr)
    work = rl_groups(groups, 8, seed, args.engine_new_tokens, tokens_seed=words)
    out = await asyncio.to_thread(slime.answer, [p for p, _ in work], seed, [b for _, b in work])
    assert out["groups"] == groups, f"slime returned {out['groups']} groups of {groups}"
    prompt = sum(len(p) for p, _ in work)
    return (out["prompt_tokens"] - out["cached_tokens"]) / prompt, out["tokens"] / out["seconds"], None, {}


async def _engine_arm(mgr, placement, groups, args, seed, words):
    await _flush(mgr)
    mgr.dispatcher.placement = placement
    primed0 = placement.primer_prefilled if placement else 0
    primers0 = dict(placement.primer_at) if placement else {}
    work = rl_groups(groups, 8, seed, args.engine_new_tokens, tokens_seed=words)
    todo = []
    for prompt, budgets in work:
        g = mgr.new_group(prompt)
        for s, b in zip(g.samples, budgets):
            s.max_new_tokens = b
        todo.append(g)
    t0 = time.monotonic()
    res = await mgr.rollout(todo, _Sink())
    wall = time.monotonic() - t0
    metas = [(s.engine, m) for g in todo for s in g.samples for _, _, m in s.outputs]
    prefilled = sum(int(m["prompt_tokens"]) - int(m["cached_tokens"]) for _, m in metas)
    prefilled += (placement.primer_prefilled - primed0) if placement else 0
    primers = {k: v - primers0.get(k, 0) for k, v in placement.primer_at.items()} if placement else {}
    tokens = sum(len(s.response_ids) for g in todo for s in g.samples)
    ranks = {}
    for g in todo:
        for s in g.samples:
            key = f"{s.engine}/{s.outputs[-1][2].get('dp_rank')}"
            ranks[key] = ranks.get(key, 0) + 1
    assert res.delivered == groups and res.failed_samples == 0, res
    prompt = sum(len(p) for p, _ in work)
    return prefilled / prompt, tokens / wall, _rank_work(metas, primers), dict(sorted(ranks.items()))


def engines_part(args) -> None:
    from rollout.config import preset_path

    from _tiny import slime_arm, started_manager

    cfg, model = _engine_config(args)
    skipped = unavailable(args.slime_src)
    print(f"{BENCH}: real engines: 2 x tiny-cpu-dpattn (dp 2, NEXTN, chunk 4096), {args.engine_groups} groups x 8, "
          f"prompts of 128-1,024 tokens ({PREFIX_LEN} shared), budgets {args.engine_new_tokens // 2}-"
          f"{args.engine_new_tokens} tokens, one in 8 samples 8-16x that; starting...", flush=True)
    res, arms = {}, ("placement", "today") + (() if skipped else ("slime",))

    async def run():
        mgr = await started_manager(cfg, model, "group-placement-")
        slime = None
        try:
            mgr.dispatcher.keep_answers = True
            placement = mgr.dispatcher.placement
            if not skipped:
                slime = slime_arm(args, cfg, model, mgr, preset_path("c"), {
                    "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
                    "sglang_server_concurrency": cfg.rollout.concurrency_per_engine})

            async def one(arm, seed, words):
                if arm == "slime":
                    return await _slime_arm(mgr, slime, args.engine_groups, args, seed, words)
                return await _engine_arm(mgr, placement if arm == "placement" else None, args.engine_groups,
                                         args, seed, words)
            for i, arm in enumerate(arms):   # warm-up of every arm's batch shapes, not counted
                await one(arm, 7 + i, 7 + i)
            for r in range(args.rounds):     # a round: one step (lengths, budgets) for every arm, own prompts
                for arm in (arms if r % 2 == 0 else arms[::-1]):
                    out = await one(arm, 100 + 10 * r, 100 + 10 * r + arms.index(arm))
                    res.setdefault(arm, []).append(out)
                    print(f"  {arm:9s} round {r}: prefilled/prompt {out[0]:.3f}, {out[1]:.1f} tokens/s"
                          + (f", rank work max/mean {out[2]:.3f}" if out[2] is not None else "")
                          + (f", samples per engine/rank {out[3]}" if out[3] else ""), flush=True)
        finally:
            if slime:
                slime.close()
            await mgr.stop()
    asyncio.run(run())
    mean = lambda arm, i: sum(x[i] for x in res[arm]) / len(res[arm])  # noqa: E731
    judge(BENCH, "engine_prefill", mean("placement", 0))
    judge(BENCH, "engine_prefill_vs_today", mean("placement", 0) / mean("today", 0))
    judge(BENCH, "engine_tokens_per_s", mean("placement", 1) / mean("today", 1))
    judge(BENCH, "engine_rank_imbalance", mean("placement", 2))
    fact(BENCH, f"today's routing: rank work max/mean {mean('today', 2):.3f}")
    if skipped:
        fact(BENCH, f"slime's arm skipped: {skipped}")
        return
    judge(BENCH, "engine_prefill_vs_slime", mean("placement", 0) / mean("slime", 0))
    judge(BENCH, "engine_tokens_per_s_vs_slime", mean("placement", 1) / mean("slime", 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-groups", type=int, default=12)
    ap.add_argument("--engine-new-tokens", type=int, default=8, help="the short budget (the long tail: 8-16x)")
    ap.add_argument("--slime-src", default=os.environ.get("SLIME_SRC") or None,
                    help="a slime checkout (default: $SLIME_SRC): slime's own generate_rollout as a third arm")
    engines_part(ap.parse_args())
    return finish()


if __name__ == "__main__":
    sys.exit(main())
