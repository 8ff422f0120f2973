"""Time until the trainer holds its first group: streaming vs waiting for the whole batch.

One real SGLang CPU engine (tiny GLM-4.5 MoE, training_configs/tiny-cpu.yaml with 1 engine).
In the same rollout, the trainer-side consumer records when the first group arrives (streaming,
this manager) and when the last one does (what a trainer that waits for the whole batch, like
slime's `generate()` returning one batched ObjectRef, would see as its first data). Printed:
both times and their ratio, averaged over --rounds rollouts of the same engine.
"""
import argparse
import asyncio
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _tiny import one_engine_config  # noqa: E402


async def run(args):
    from rich.console import Console
    from rich.progress import Progress

    from rollout.engines.engine_launch import free_port
    from rollout.engines.lifecycle import LocalBackend
    from rollout.manager import RolloutManager
    from rollout.engines.readiness import RichView
    from rollout.cli.run import prompts_for
    from rollout.stream import GroupStream

    cfg, model = one_engine_config(args.max_new_tokens)
    logs = tempfile.mkdtemp(prefix="bench-first-group-")
    with Progress(console=Console(stderr=True), transient=True) as progress:
        mgr = RolloutManager.from_config(cfg, LocalBackend(logs), model, ports=[free_port()],
                                         view=RichView(progress))
        await mgr.start()
    firsts, wholes = [], []
    try:
        for r in range(args.rounds):
            stream = GroupStream(maxsize=args.groups)
            arrivals = []
            t0 = time.monotonic()

            async def consume():
                async for _ in stream:
                    arrivals.append(time.monotonic() - t0)

            c = asyncio.create_task(consume())
            res = await mgr.rollout(prompts_for(300, args.groups, seed=r), stream, batch_size=args.groups)
            await stream.close()
            await c
            assert res.delivered == args.groups == len(arrivals)
            firsts.append(arrivals[0])
            wholes.append(arrivals[-1])
    finally:
        await mgr.stop()
    f, w = sum(firsts) / len(firsts), sum(wholes) / len(wholes)
    print(f"first group: 1 real SGLang CPU engine, {args.groups} groups x {cfg.rollout.n_samples_per_prompt} samples, "
          f"{args.max_new_tokens} new tokens, concurrency {cfg.rollout.concurrency_per_engine}, {args.rounds} rounds")
    print(f"  streaming (this manager): first group after {f:.2f} s")
    print(f"  whole-batch wait        : first data after  {w:.2f} s")
    print(f"  the trainer holds data {w / f:.1f}x sooner")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
