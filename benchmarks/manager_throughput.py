"""Rollout throughput: this manager vs direct concurrent HTTP to the same engine, alternated a/b/b/a.

One real SGLang CPU engine (tiny GLM-4.5 MoE, routed experts on), the config's concurrency. The same
sampling (`ignore_eos`: both sides generate the same number of tokens), logprobs and routed experts:
  (a) direct: slime's generate_rollout request shape (benchmarks/_tiny.barrier_batch: every sample
      at once behind one semaphore of concurrency x engines, a bare POST /generate each);
  (b) manager: RolloutManager.rollout (dispatch, R3 decode + validation + compaction, group assembly,
      streaming to a consumer).
  (c) with --slime-src DIR: slime's own generate_rollout through slime's router on the same engine
      (benchmarks/_slime_arm.py; its client runs under SLIME_PYTHON, SGLang 0.5.15.post1).
Each pair runs the same fresh prompts on every arm (prefix cache flushed before every run); the order
alternates a/b(/c), (c/)b/a. Printed: tokens/s and groups/s of each; judged: median over pairs of
b / a tokens/s, and with --slime-src b / c.
"""
import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _targets import finish, judge  # noqa: E402
from _tiny import (barrier_batch, batch_args, flush_cache, median, one_engine_config, slime_arm,  # noqa: E402
                   started_manager, streamed_batch)


async def run(args):
    from rollout.cli.run import prompts_for

    cfg, model = one_engine_config(args.max_new_tokens)
    mgr = await started_manager(cfg, model, "bench-tput-")
    slime = None
    rates = {"direct": [], "manager": []}
    try:
        slime = slime_arm(args, cfg, model, mgr)
        arms = ("direct", "manager") + (("slime",) if slime else ())
        rates.update({"slime": []} if slime else {})
        await barrier_batch(mgr, prompts_for(300, 2, seed=99))  # warm-up, not timed
        if slime:
            await asyncio.to_thread(slime.rollout, prompts_for(300, 2, seed=98), 0)
        for r in range(args.pairs):
            prompts = prompts_for(300, args.groups, seed=100 + r)
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                await flush_cache(mgr)
                if arm == "direct":
                    dt, tokens = await barrier_batch(mgr, prompts)
                elif arm == "slime":
                    dt, tokens, groups = await asyncio.to_thread(slime.rollout, prompts, r + 1)
                    assert groups == len(prompts), f"slime returned {groups} groups of {len(prompts)}"
                else:
                    _, dt, tokens = await streamed_batch(mgr, prompts)
                rates[arm].append((tokens / dt, len(prompts) / dt))
    finally:
        if slime:
            slime.close()
        await mgr.stop()
    n, conc = cfg.rollout.n_samples_per_prompt, cfg.rollout.concurrency_per_engine
    print(f"manager throughput: 1 real SGLang CPU engine, {args.groups} groups x {n} samples x "
          f"{args.max_new_tokens} tokens, concurrency {conc}, logprobs + routed experts, {args.pairs} pairs a/b/b/a")
    for arm in rates:
        tok = [x[0] for x in rates[arm]]
        print(f"  {arm:8s}: median {median(tok):7.1f} tokens/s, {median([x[1] for x in rates[arm]]):5.2f} groups/s "
              f"(runs: {', '.join(f'{x:.1f}' for x in tok)})")
    judge("manager_throughput", "tokens", median([m[0] / d[0] for d, m in zip(rates["direct"], rates["manager"])]))
    if slime:
        judge("manager_throughput", "tokens_vs_slime",
              median([m[0] / s[0] for s, m in zip(rates["slime"], rates["manager"])]))
    return finish()


def main():
    args = batch_args(__doc__, pairs=4, slime_help="a slime checkout: slime's own generate_rollout as arm (c)")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
