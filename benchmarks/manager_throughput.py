"""Manager throughput vs direct concurrent HTTP to the same engine.

One real SGLang CPU engine (tiny GLM-4.5 MoE, routed experts on). The same prompts, sampling
(`ignore_eos`, so both sides generate the same number of tokens), logprobs and routed experts,
and the same concurrency go (a) straight to /generate with aiohttp and (b) through the manager
(dispatch, R3 decode + validation + compaction, group assembly, streaming). After an untimed warm-up,
rounds alternate a/b, b/a with fresh prompts, so load drift on the shared machine hits both. Printed: tokens/s of each and the ratio.
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


async def direct(mgr, prompts, n, sampling, concurrency):
    import aiohttp
    eng = next(iter(mgr.engines.values()))
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(p, i):
        nonlocal tokens
        async with sem:
            body = {"input_ids": p, "sampling_params": sampling, "return_logprob": True,
                    "return_routed_experts": True, "rid": f"direct-{time.monotonic_ns()}-{i}"}
            async with mgr.session.post(eng.url + "/generate", json=body,
                                        headers={"Authorization": f"Bearer {eng.api_key}"},
                                        timeout=aiohttp.ClientTimeout(total=600)) as r:
                out = await r.json()
            tokens += len(out["meta_info"]["output_token_logprobs"])

    t0 = time.monotonic()
    await asyncio.gather(*(one(p, i) for p in prompts for i in range(n)))
    return tokens / (time.monotonic() - t0)


async def managed(mgr, prompts):
    from rollout.stream import GroupStream
    stream = GroupStream(maxsize=len(prompts) + 1)  # + the end marker: read after the rollout
    t0 = time.monotonic()
    res = await mgr.rollout(prompts, stream, batch_size=len(prompts))
    dt = time.monotonic() - t0
    await stream.close()
    groups = [g async for g in stream]
    assert res.delivered == len(prompts)
    assert all(s.routed_experts is not None for g in groups for s in g.samples)
    return sum(len(s.response_ids) for g in groups for s in g.samples) / dt


async def run(args):
    from rich.console import Console
    from rich.progress import Progress

    from rollout.engines.engine_launch import free_port
    from rollout.engines.lifecycle import LocalBackend
    from rollout.manager import RolloutManager
    from rollout.engines.readiness import RichView
    from rollout.cli.run import prompts_for

    cfg, model = one_engine_config(args.max_new_tokens)
    with Progress(console=Console(stderr=True), transient=True) as progress:
        mgr = RolloutManager.from_config(cfg, LocalBackend(tempfile.mkdtemp(prefix="bench-tput-")), model,
                                         ports=[free_port()], view=RichView(progress))
        await mgr.start()
    mgr.dispatcher.sampling["ignore_eos"] = True
    sampling = dict(mgr.dispatcher.sampling)
    n, conc = cfg.rollout.n_samples_per_prompt, cfg.rollout.concurrency_per_engine
    rates = {"direct": [], "manager": []}
    try:
        await direct(mgr, prompts_for(300, args.groups, seed=99), n, sampling, conc)  # warm-up, not timed
        for r in range(args.rounds):
            # fresh prompts for every run (no prefix-cache help for either side), order alternating
            pa, pb = prompts_for(300, args.groups, seed=100 + 2 * r), prompts_for(300, args.groups, seed=101 + 2 * r)
            runs = [("direct", lambda: direct(mgr, pa, n, sampling, conc)), ("manager", lambda: managed(mgr, pb))]
            for name, fn in (runs if r % 2 == 0 else runs[::-1]):
                rates[name].append(await fn())
    finally:
        await mgr.stop()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731  (medians: load spikes on a shared machine)
    ratios = [m / d for d, m in zip(rates["direct"], rates["manager"])]  # back-to-back pairs
    print(f"manager throughput: 1 real SGLang CPU engine, {args.groups} groups x {n} samples x "
          f"{args.max_new_tokens} tokens, concurrency {conc}, logprobs + routed experts, {args.rounds} rounds a/b b/a")
    print(f"  direct HTTP : median {med(rates['direct']):7.1f} tokens/s  (rounds: "
          f"{', '.join(f'{x:.1f}' for x in rates['direct'])})")
    print(f"  manager     : median {med(rates['manager']):7.1f} tokens/s  (rounds: "
          f"{', '.join(f'{x:.1f}' for x in rates['manager'])})")
    print(f"  manager / direct, median of back-to-back pairs: {med(ratios):.2f}x "
          f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
