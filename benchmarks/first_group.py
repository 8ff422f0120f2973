"""Time until the trainer holds its first group: this manager's streaming vs slime's batch barrier.

One real SGLang CPU engine (tiny GLM-4.5 MoE, training_configs/tiny-cpu.yaml with 1 engine). Two
separate runs of the SAME prompts on the same engine, alternated a/b/b/a (prefix cache flushed
before every run):
  (a) streaming: RolloutManager.rollout; the trainer-side consumer records the first group's arrival;
  (b) batch barrier: slime's generate_rollout shape (every sample at once behind one semaphore of
      concurrency x engines, the batch returned whole, see benchmarks/_tiny.barrier_batch): the
      trainer's first data arrives when the last sample is done.
With --slime-src DIR, (b) is slime's own generate_rollout through slime's router on the same engine
(benchmarks/_slime_arm.py; timed inside slime's process around the call that hands the trainer data).
Judged (benchmarks/targets.toml): median over pairs of (a) first group / (b) batch time.
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
    mgr = await started_manager(cfg, model, "bench-first-group-")
    firsts, barriers, pairs, slime = [], [], [], None
    try:
        slime = slime_arm(args, cfg, model, mgr)
        await barrier_batch(mgr, prompts_for(300, 2, seed=99))  # warm-up, not timed
        if slime:
            await asyncio.to_thread(slime.rollout, prompts_for(300, 2, seed=98), 0)
        for r in range(args.pairs):
            prompts = prompts_for(300, args.groups, seed=r)
            got = {}
            for arm in (("stream", "barrier") if r % 2 == 0 else ("barrier", "stream")):
                await flush_cache(mgr)
                if arm == "stream":
                    got[arm] = (await streamed_batch(mgr, prompts))[0]
                elif slime:
                    got[arm] = (await asyncio.to_thread(slime.rollout, prompts, r + 1))[0]
                else:
                    got[arm] = (await barrier_batch(mgr, prompts))[0]
            firsts.append(got["stream"])
            barriers.append(got["barrier"])
            pairs.append(got["stream"] / got["barrier"])
            print(f"  pair {r + 1}: streaming first group {got['stream']:.2f} s, barrier {got['barrier']:.2f} s",
                  file=sys.stderr)
    finally:
        if slime:
            slime.close()
        await mgr.stop()
    print(f"first group: 1 real SGLang CPU engine, {args.groups} groups x {cfg.rollout.n_samples_per_prompt} samples, "
          f"{args.max_new_tokens} new tokens, concurrency {cfg.rollout.concurrency_per_engine}, "
          f"{args.pairs} pairs a/b/b/a (same prompts per pair, cache flushed)")
    print(f"  (a) streaming, this manager: first group after {median(firsts):.2f} s (median)")
    what = "slime's own generate_rollout" if slime else "slime's generate_rollout shape"
    print(f"  (b) batch barrier ({what}): first data after {median(barriers):.2f} s (median)")
    judge("first_group", "first_data", median(pairs))
    return finish()


def main():
    args = batch_args(__doc__, pairs=2, slime_help="a slime checkout: slime's own generate_rollout is the barrier arm")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
