"""Group placement vs today's per-sample routing (and a stand-in of slime's path): prompt tokens prefilled
per group, rank balance, dispatcher CPU; on a loopback stand-in at the seed's scale, and on real engines.

    python benchmarks/group_placement.py [--groups 512] [--n 16]            # the scale run (no engines)
    flock /tmp/engine.lock python benchmarks/group_placement.py --engines   # + benchmarks/group_placement_engines.py

Scale run: 4 engines x dp 4 = 16 ranks, 512 groups x 16 = 8,192 samples of an RL-like step
(`group_placement_engines.rl_groups`: prompts of 128-1,024 tokens behind a shared 64-token system
prefix; per-sample budgets, most between `--short` / 2 and `--short`, one in 8 8-16x that, generated to
the last token), served by a BENCHMARK-ONLY STAND-IN OF SGLANG (a subprocess, one HTTP server per
engine) that answers as SGLang 0.5.23 does where it matters here: each DP rank keeps its own prefix
cache and runs at most concurrency / dp requests; a request without `routed_dp_rank` goes to the
engine's ranks in round robin (SGLang's default load_balance_method); requests that reach a rank in the
same scheduler step are prefilled together, each checked only against what the cache held before that
step (the default `fcfs` policy); a hit on a whole prompt reports `cached_tokens` = prompt_tokens minus
the tail a real engine recomputes (recorded: tests/facts/sglang-0.5.23-prefix-cache.json, the
DP-attention miniature with NEXTN), a hit on the system prefix alone that prefix but its last token
(recorded there too). The ranks of an
engine step together (DP attention): a step lasts `--step-s` plus the slowest rank's work (prefilled
tokens x `--prefill-token-s` + running requests x `--token-s`); a rank's busy time is its own work.
Arms, on the same stand-ins, alternated, fresh caches, each warmed up first (16 groups, not counted):
  placement: rollout.dispatch.Dispatcher with rollout.placement.Placement (group placement, primer);
  today    : the same Dispatcher without a placement (least-outstanding engine per sample);
  slime    : a stand-in of slime's path: sglang-router's cache_aware policy as slime sets it (a worker
             that saw the prompt gets it unless loads differ by > 10 and > 1.2x; else the least loaded),
             then SGLang's round robin over the engine's ranks.
Printed and judged (means over rounds): prefilled prompt tokens / prompt tokens (primers included; the
shared prefix cached makes it < 1), placement / today and / slime; rank imbalance (max / mean busy time
per rank); rollout tokens/s, placement / today and / slime; client CPU per request (process CPU /
samples), placement / today. bench-quick runs one engine of the 4 ranks (`--engine-count 1`), 64 groups
with `--short 8`: 16 groups per rank, 8 in flight per rank, arriving as others finish as at full size.
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
PREFIX_TAIL = 1   # a longer prompt behind a cached one: all but 1 of its tokens cached (the fact file's answer 3)


def recorded_tail() -> int:
    """Prompt tokens a real DP-attention engine (NEXTN) prefills again for a prompt its rank has cached."""
    with open(FACT) as fh:
        again = json.load(fh)["c"]["answers"][1]
    return int(again["prompt_tokens"]) - int(again["cached_tokens"])


# ---------------------------------------------------------------- the stand-in (subprocess)

class _Rank:
    def __init__(self):
        self.cache, self.waiting, self.running = set(), [], []
        self.prefilled = self.served = self.busy = 0.0


def _serve(ports, dp, tail, prefix_len, per_rank, cost, ready, cpu):
    """One engine per port, its `dp` ranks stepping together (DP attention): each step every rank takes
    waiting requests up to `per_rank` running, prefills them (fcfs: each checked against the cache as it
    was before the step) and decodes one token of every running request; the step lasts as long as the
    slowest rank's work: cost = (step_s, s per prefilled token, s per decoded token)."""
    from aiohttp import web

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    step_s, prefill_s, decode_s = cost

    def cached_of(rank, ids):
        if hash(tuple(ids)) in rank.cache:
            return max(0, len(ids) - tail)
        if prefix_len and len(ids) > prefix_len and hash(tuple(ids[:prefix_len])) in rank.cache:
            return prefix_len - PREFIX_TAIL
        return 0

    async def main():
        runners = []
        for port in ports:
            ranks, rr, wake = [_Rank() for _ in range(dp)], [0], asyncio.Event()

            async def step_loop(ranks=ranks, wake=wake):
                try:
                    await steps(ranks, wake)
                except BaseException as e:
                    print(f"stand-in step loop: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    raise

            async def steps(ranks, wake):
                while True:
                    if not any(k.waiting or k.running for k in ranks):
                        wake.clear()
                        await wake.wait()
                    work = []
                    for rank in ranks:
                        take = max(0, per_rank - len(rank.running))
                        batch, rank.waiting = rank.waiting[:take], rank.waiting[take:]
                        new = sum(req["n"] - cached_of(rank, req["ids"]) for req in batch)   # fcfs
                        for req in batch:
                            req["cached"] = cached_of(rank, req["ids"])
                        for req in batch:
                            rank.cache.add(hash(tuple(req["ids"])))
                            if prefix_len and len(req["ids"]) > prefix_len:
                                rank.cache.add(hash(tuple(req["ids"][:prefix_len])))
                        decoding = [q for q in rank.running if q["left"] > 0]
                        t = prefill_s * new + decode_s * len(decoding)
                        rank.prefilled += new
                        rank.busy += t
                        rank.served += new + len(decoding)
                        for q in decoding:
                            q["left"] -= 1
                        running, rank.running = rank.running + batch, []
                        for q in running:
                            if q["left"] > 0:
                                rank.running.append(q)
                            else:
                                q["fut"].set_result(q["cached"])
                        work.append(t)
                    await asyncio.sleep(step_s + max(work))

            async def generate(request, ranks=ranks, rr=rr, wake=wake):
                body = await request.json()
                r = body.get("routed_dp_rank")
                if r is None:
                    r, rr[0] = rr[0] % dp, rr[0] + 1
                ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
                fut = asyncio.get_running_loop().create_future()
                ranks[r].waiting.append({"ids": ids, "n": len(ids), "left": n, "fut": fut})
                wake.set()
                cached = await fut
                return web.json_response({"text": "", "meta_info": {
                    "output_token_logprobs": [[-1.0, 5 + i % 50, None] for i in range(n)],
                    "finish_reason": {"type": "length", "length": n}, "prompt_tokens": len(ids),
                    "cached_tokens": cached, "completion_tokens": n, "dp_rank": r, "weight_version": "default"}})

            async def stats(request, ranks=ranks):
                out = [{"prefilled": k.prefilled, "served": k.served, "busy": k.busy} for k in ranks]
                for k in ranks:
                    k.cache.clear()
                    k.prefilled = k.served = k.busy = 0.0
                return web.json_response(out)

            app = web.Application(client_max_size=1 << 26)
            app.router.add_post("/generate", generate)
            app.router.add_post("/stats", stats)
            asyncio.get_running_loop().create_task(step_loop())
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


def _workload(groups, n, seed, short):
    from group_placement_engines import rl_groups

    from rollout.types import Group

    work = []
    for i, (prompt, budgets) in enumerate(rl_groups(groups, n, seed, short, vocab=30000)):
        g = Group.fresh(f"g{seed}-{i}", prompt, n)
        for smp, b in zip(g.samples, budgets):
            smp.max_new_tokens = b
        work.append(g)
    return work


async def _stats(session, engines):
    out = []
    for e in engines:
        async with session.post(e.url + "/stats") as r:
            out += await r.json()
    return out


async def _dispatcher_arm(client, engines, dp, work, n, concurrency, placed):
    from rollout.dispatch import Dispatcher
    from rollout.inflight import InFlight, bound
    from rollout.placement import Placement

    d = Dispatcher(client, {"max_new_tokens": 16}, concurrency,
                   placement=Placement(n, concurrency) if placed else None)
    for e in engines:
        await d.admit(e, dp_ranks=dp)
    gate = InFlight(bound(concurrency, len(engines), n))   # the manager's bound on unfinished samples

    async def one(s):
        await d.run(s)
        gate.leave(1)

    async def group(g):
        await gate.enter(len(g.samples))
        await asyncio.gather(*(one(s) for s in g.samples))
    await asyncio.gather(*(group(g) for g in d.longest_first(work)))   # the manager's start order
    return d.resent


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
                body = {"input_ids": s.prompt_ids, "sampling_params": {"max_new_tokens": s.max_new_tokens},
                        "return_logprob": True}
                async with session.post(e.url + "/generate", json=body) as r:
                    await r.json()
            finally:
                load[e.name] -= 1
    await asyncio.gather(*(one(s) for g in work for s in g.samples))


def _summary(stats, work, wall):
    """(prefilled / prompt tokens, rank busy time max / mean, tokens generated per second)."""
    prompt = sum(len(g.prompt_ids) for g in work)
    busy = [r["busy"] for r in stats]
    tokens = sum(s.max_new_tokens for g in work for s in g.samples)
    return sum(r["prefilled"] for r in stats) / prompt, max(busy) / (sum(busy) / len(busy)), tokens / wall


def scale(args) -> None:
    import aiohttp

    from rollout.engines.client import EngineClient

    from rollout.net import free_port

    tail = recorded_tail()
    fact(BENCH, f"stand-in: a cached prompt re-prefills {tail} token(s), as recorded from SGLang 0.5.23 (NEXTN)")
    engines_n, dp = args.engine_count, args.dp
    ports = [free_port() for _ in range(engines_n)]
    cpus = sorted(os.sched_getaffinity(0))
    ready = mp.Event()
    from group_placement_engines import PREFIX_LEN
    cost = (args.step_s, args.prefill_token_s, args.token_s)
    srv = mp.Process(target=_serve, args=(ports, dp, tail, PREFIX_LEN, args.concurrency // dp, cost, ready,
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
            async def one(arm, seed, groups=args.groups):
                work = _workload(groups, args.n, seed, args.short)
                await _stats(session, engines)
                t0, c0 = time.monotonic(), time.process_time()
                resent = 0
                if arm == "slime":
                    await _slime_arm(session, engines, work, args.concurrency)
                else:
                    resent = await _dispatcher_arm(client, engines, dp, work, args.n, args.concurrency,
                                                   arm == "placement")
                if resent:
                    print(f"  ({arm}: {resent} request(s) re-sent after connection errors or 5xx)", flush=True)
                cpu, wall = time.process_time() - c0, time.monotonic() - t0
                return _summary(await _stats(session, engines), work, wall) + (cpu / (groups * args.n),)
            arms = ("placement", "today", "slime")
            for i, arm in enumerate(arms):     # warm-up: connections, imports, first allocations; not counted
                await one(arm, seed=7 + i, groups=min(args.groups, 16))
            for r in range(args.rounds):
                for arm in (arms if r % 2 == 0 else arms[::-1]):
                    out = await one(arm, seed=1000 * r)   # every arm the same step (caches emptied between)
                    res.setdefault(arm, []).append(out)
                    print(f"  {arm:9s} round {r}: prefilled/prompt {out[0]:.3f}, rank busy imbalance {out[1]:.3f}, "
                          f"{out[2]:.0f} tokens/s, client CPU {1e6 * out[3]:.0f} us/request"
                          + (" (a stand-in of slime's path, not slime's client)" if arm == "slime" else ""),
                          flush=True)

    try:
        asyncio.run(run())
    finally:
        srv.kill()
    mean = lambda arm, i: sum(x[i] for x in res[arm]) / len(res[arm])  # noqa: E731
    judge(BENCH, "scale_prefill", mean("placement", 0))
    judge(BENCH, "scale_prefill_vs_today", mean("placement", 0) / mean("today", 0))
    judge(BENCH, "scale_prefill_vs_slime", mean("placement", 0) / mean("slime", 0))
    judge(BENCH, "scale_rank_imbalance", mean("placement", 1))
    judge(BENCH, "scale_tokens_per_s", mean("placement", 2) / mean("today", 2))
    judge(BENCH, "scale_tokens_per_s_vs_slime", mean("placement", 2) / mean("slime", 2))
    judge(BENCH, "scale_cpu_per_request", mean("placement", 3) / mean("today", 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=512)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=512, help="per engine (the seed config's)")
    ap.add_argument("--engine-count", type=int, default=4, help="stand-in engines of the scale run")
    ap.add_argument("--dp", type=int, default=4, help="DP ranks per stand-in engine (the seed's dp 4)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short", type=int, default=16, help="the short response budget (the long tail: 8-16x)")
    ap.add_argument("--step-s", type=float, default=0.03, help="stand-in time of one scheduler step")
    ap.add_argument("--prefill-token-s", type=float, default=2e-5, help="stand-in time per prefilled token")
    ap.add_argument("--token-s", type=float, default=1e-4, help="stand-in time per decoded token (per request)")
    ap.add_argument("--engines", action="store_true", help="also the real-engine part (two CPU engines)")
    ap.add_argument("--engine-groups", type=int, default=12)
    ap.add_argument("--engine-new-tokens", type=int, default=8)
    args = ap.parse_args()
    print(f"{BENCH}: scale run, {args.groups} groups x {args.n}, {args.engine_count} engine(s) x dp {args.dp}", flush=True)
    scale(args)
    if args.engines:
        from group_placement_engines import engines_part
        engines_part(args)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
