"""Group placement vs today's per-sample routing (and a stand-in of slime's path): prompt tokens prefilled
per group, rank balance, dispatcher CPU; on a loopback stand-in at the seed's scale, and on real engines.

    python benchmarks/group_placement.py [--groups 512] [--n 16]            # the scale run (no engines)
    flock /tmp/engine.lock python benchmarks/group_placement.py --engines   # + benchmarks/group_placement_engines.py

Scale run: 4 engines x dp 4 = 16 ranks, 512 groups x 16 = 8,192 samples, prompts of 128-2,048 tokens,
served by a BENCHMARK-ONLY STAND-IN OF SGLANG (a subprocess, one HTTP server per engine) that answers
as SGLang 0.5.23 does where it matters here: each DP rank keeps its own prefix cache; a request
without `routed_dp_rank` goes to the engine's ranks in round robin (SGLang's default
load_balance_method); requests that reach a rank in the same scheduler step are prefilled together,
each checked only against what the cache held before that step (the default `fcfs` policy), and a
prompt enters the cache once prefilled; a hit reports `cached_tokens` = prompt_tokens minus the tail
a real engine recomputes (recorded: tests/facts/sglang-0.5.23-prefix-cache.json, the DP-attention
miniature with NEXTN). The stand-in matches whole prompts only (every request here is one).
Arms, on the same stand-ins, one after the other with fresh caches:
  placement: rollout.dispatch.Dispatcher with rollout.placement.Placement (group placement, primer);
  today    : the same Dispatcher without a placement (least-outstanding engine per sample);
  slime    : a stand-in of slime's path: sglang-router's cache_aware policy as slime sets it (a worker
             that saw the prompt gets it unless loads differ by > 10 and > 1.2x; else the least loaded),
             then SGLang's round robin over the engine's ranks; prefill and balance only.
Printed and judged: prefilled prompt tokens / prompt tokens (summed over groups, primers included),
the ratios of placement to today and to slime, rank imbalance (max / mean of tokens served per
rank), client CPU per request (process CPU / samples) of placement vs today.
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _targets import fact, finish, judge  # noqa: E402

FACT = os.path.join(ROOT, "tests", "facts", "sglang-0.5.23-prefix-cache.json")
BENCH = "group_placement"


def recorded_tail() -> int:
    """Prompt tokens a real DP-attention engine (NEXTN) prefills again for a prompt its rank has cached."""
    with open(FACT) as fh:
        again = json.load(fh)["c"]["answers"][1]
    return int(again["prompt_tokens"]) - int(again["cached_tokens"])


# ---------------------------------------------------------------- the stand-in (subprocess)

class _Rank:
    def __init__(self):
        self.cache, self.waiting, self.prefilled, self.served, self.prompts = set(), [], 0, 0, 0


def _serve(ports, dp, tail, step_s, token_s, ready, cpu):
    from aiohttp import web

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    async def main():
        runners = []
        for port in ports:
            ranks, rr = [_Rank() for _ in range(dp)], [0]

            async def step_loop(rank):
                while True:
                    await asyncio.sleep(step_s)
                    batch, rank.waiting = rank.waiting, []
                    hits = [(key in rank.cache) for key, _, _ in batch]   # fcfs: no in-batch prefix check
                    for (key, n, fut), hit in zip(batch, hits):
                        cached = max(0, n - tail) if hit else 0
                        rank.prefilled += n - cached
                        rank.cache.add(key)
                        fut.set_result(cached)

            async def generate(request, ranks=ranks, rr=rr):
                body = await request.json()
                r = body.get("routed_dp_rank")
                if r is None:
                    r, rr[0] = rr[0] % dp, rr[0] + 1
                rank, ids = ranks[r], body["input_ids"]
                fut = asyncio.get_running_loop().create_future()
                rank.waiting.append((hash(tuple(ids)), len(ids), fut))
                cached = await fut
                n = body["sampling_params"]["max_new_tokens"]
                await asyncio.sleep(token_s * n)
                rank.served += len(ids) + n
                rank.prompts += len(ids)
                return web.json_response({"text": "", "meta_info": {
                    "output_token_logprobs": [[-1.0, 5 + i % 50, None] for i in range(n)],
                    "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ids),
                    "cached_tokens": cached, "completion_tokens": n, "dp_rank": r, "weight_version": "default"}})

            async def stats(request, ranks=ranks):
                out = [{"prefilled": k.prefilled, "served": k.served} for k in ranks]
                for k in ranks:
                    k.cache.clear()
                    k.prefilled = k.served = k.prompts = 0
                return web.json_response(out)

            app = web.Application(client_max_size=1 << 26)
            app.router.add_post("/generate", generate)
            app.router.add_post("/stats", stats)
            for k in ranks:
                asyncio.get_running_loop().create_task(step_loop(k))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
            runners.append(runner)
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


# ---------------------------------------------------------------- the client arms

class _Eng:
    def __init__(self, i, port):
        self.name, self.url, self.api_key = f"e{i}", f"http://127.0.0.1:{port}", None


def _workload(groups, n, seed):
    from rollout.types import Group

    rng = random.Random(seed)
    lengths = [rng.choice((128, 256, 512, 1024, 2048)) for _ in range(groups)]
    return [Group.fresh(f"g{seed}-{i}", [rng.randrange(3, 30000) for _ in range(k)], n) for i, k in enumerate(lengths)]


async def _stats(session, engines):
    out = []
    for e in engines:
        async with session.post(e.url + "/stats") as r:
            out += await r.json()
    return out


async def _dispatcher_arm(client, engines, dp, work, n, concurrency, placed, max_new):
    from rollout.dispatch import Dispatcher
    from rollout.placement import Placement

    d = Dispatcher(client, {"max_new_tokens": max_new}, concurrency,
                   placement=Placement(n, concurrency) if placed else None)
    for e in engines:
        await d.admit(e, dp_ranks=dp)
    gate = asyncio.Semaphore(max(1, concurrency * len(engines) // n) * 2)   # the manager's group gate

    async def group(g):
        async with gate:
            await asyncio.gather(*(d.run(s) for s in g.samples))
    c0 = time.process_time()
    await asyncio.gather(*(group(g) for g in work))
    return time.process_time() - c0


async def _slime_arm(session, engines, work, concurrency):
    """A stand-in of slime's path (not slime's code): cache_aware over engines as slime sets the
    router (balance_abs_threshold 10, balance_rel_threshold 1.2), the engine's round robin over ranks."""
    load = {e.name: 0 for e in engines}
    seen = {e.name: set() for e in engines}
    sem = asyncio.Semaphore(concurrency * len(engines))

    def pick(key):
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > 10 and hi > 1.2 * max(lo, 1):
            return min(engines, key=lambda e: load[e.name])
        for e in engines:
            if key in seen[e.name]:
                return e
        return min(engines, key=lambda e: load[e.name])

    async def one(s):
        async with sem:
            e = pick(hash(tuple(s.prompt_ids)))
            seen[e.name].add(hash(tuple(s.prompt_ids)))
            load[e.name] += 1
            try:
                body = {"input_ids": s.prompt_ids, "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
                async with session.post(e.url + "/generate", json=body) as r:
                    await r.json()
            finally:
                load[e.name] -= 1
    await asyncio.gather(*(one(s) for g in work for s in g.samples))


def _summary(stats, work):
    prompt = sum(len(g.prompt_ids) for g in work)
    served = [r["served"] for r in stats]
    return sum(r["prefilled"] for r in stats) / prompt, max(served) / (sum(served) / len(served))


def scale(args) -> None:
    import aiohttp

    from rollout.engines.client import EngineClient

    from rollout.net import free_port

    tail = recorded_tail()
    fact(BENCH, f"stand-in: a cached prompt re-prefills {tail} token(s), as recorded from SGLang 0.5.23 (NEXTN)")
    engines_n, dp = 4, 4
    ports = [free_port() for _ in range(engines_n)]
    cpus = sorted(os.sched_getaffinity(0))
    ready = mp.Event()
    srv = mp.Process(target=_serve, args=(ports, dp, tail, 0.002, args.token_s, ready,
                                          cpus[-1] if len(cpus) > 1 else None), daemon=True)
    srv.start()
    ready.wait(60)
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})
    engines = [_Eng(i, p) for i, p in enumerate(ports)]
    res = {}

    async def run():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session, \
                EngineClient() as client:
            await _stats(session, engines)
            for r in range(args.rounds):
                for arm in (("placement", "today") if r % 2 == 0 else ("today", "placement")):
                    work = _workload(args.groups, args.n, seed=1000 * r + len(res))
                    t0 = time.monotonic()
                    cpu = await _dispatcher_arm(client, engines, dp, work, args.n, args.concurrency,
                                                arm == "placement", 16)
                    prefill, imbalance = _summary(await _stats(session, engines), work)
                    res.setdefault(arm, []).append((prefill, imbalance, cpu / (args.groups * args.n)))
                    print(f"  {arm:9s} round {r}: prefilled/prompt {prefill:.3f}, rank imbalance {imbalance:.3f}, "
                          f"client CPU {1e6 * cpu / (args.groups * args.n):.0f} us/request, "
                          f"wall {time.monotonic() - t0:.1f} s", flush=True)
            work = _workload(args.groups, args.n, seed=99)
            await _slime_arm(session, engines, work, args.concurrency)
            res["slime"] = [_summary(await _stats(session, engines), work) + (0.0,)]
            print(f"  slime (stand-in of its path): prefilled/prompt {res['slime'][0][0]:.3f}, "
                  f"rank imbalance {res['slime'][0][1]:.3f}", flush=True)

    try:
        asyncio.run(run())
    finally:
        srv.kill()
    med = lambda arm, i: sorted(x[i] for x in res[arm])[len(res[arm]) // 2]  # noqa: E731
    judge(BENCH, "scale_prefill", med("placement", 0))
    judge(BENCH, "scale_prefill_vs_today", med("placement", 0) / med("today", 0))
    judge(BENCH, "scale_prefill_vs_slime", med("placement", 0) / med("slime", 0))
    judge(BENCH, "scale_rank_imbalance", med("placement", 1))
    judge(BENCH, "scale_cpu_per_request", med("placement", 2) / med("today", 2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=512, help="per engine (the seed config's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--token-s", type=float, default=0.0005, help="stand-in decode time per token")
    ap.add_argument("--engines", action="store_true", help="also the real-engine part (two CPU engines)")
    ap.add_argument("--engine-groups", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--engine-new-tokens", type=int, default=8)
    args = ap.parse_args()
    print(f"{BENCH}: scale run, {args.groups} groups x {args.n}, 4 engines x dp 4", flush=True)
    scale(args)
    if args.engines:
        from group_placement_engines import engines_part
        engines_part(args)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
