"""Dispatcher overhead at the GLM-4.5 355B job's scale: 4 engines x 512 concurrency, groups of 8, 4,096 in flight.

The GLM-4.5 355B job (training_configs/glm4.5-355b-a32b.yaml: 4 engines, concurrency_per_engine 512, n = 8)
submits 512 groups x 8 samples = 4,096 requests at once; 2,048 are on the wire, the rest wait for a
slot. The engines are replaced by a MINIMAL LOOPBACK HTTP RESPONDER (a benchmark-only stand-in, not
SGLang): it answers every POST /generate at once with a fixed 4-token body, so what is measured is
the client's own cost. The client runs pinned to one core, the responder on another.

Side by side, rounds alternated a/b/b/a, on the same responders:
  direct : slime's shape: one asyncio.Semaphore(concurrency x engines) over all requests, round-robin
           engines, a bare aiohttp POST + JSON parse, and the answer kept as slime's generate keeps it (its
           token ids and logprobs taken out and appended, as `Sample.append_response_tokens` does). slime's
           own client is httpx (`slime.utils.http_utils`), which costs more per request than aiohttp: this
           shape is a floor under slime's figure, not slime's figure;
  manager: rollout.dispatch.Dispatcher.run per sample (least-outstanding routing, per-engine slots,
           payload, response parsing into the Sample), one task per sample as the manager runs them.
What each side builds once (the manager's dispatcher and samples, the direct side's requests and records)
is built before its run is timed.
Printed at that shape ("seed") and at a shallow depth (32 in flight, batches of 32 back to back, the two
sides alternated batch by batch so that load on a shared machine hits both alike; each timed round
starts after gc.collect() and gc.freeze(), so that no side's run pays a full collection of a heap the
other side or the set-up built): requests/s (wall), client CPU per request (process CPU time /
requests: insensitive to other load on a shared machine), per-request latency p50/p99 and what the
manager adds. Judged (benchmarks/targets.toml): manager / direct
requests per CPU-second of the client core (the rate each reaches on a dedicated core), the median
over the back-to-back pairs.
"""
import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _targets import finish, judge  # noqa: E402

from rollout.net import auth_headers, free_port  # noqa: E402

BODY = json.dumps({"text": "", "meta_info": {
    "output_token_logprobs": [[-1.0, 5, None], [-1.0, 6, None], [-1.0, 7, None], [-1.0, 8, None]],
    "finish_reason": {"type": "length"}, "weight_version": "default", "completion_tokens": 4}}).encode()
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


class _Responder(asyncio.Protocol):
    """Benchmark-only stand-in: parses just enough HTTP/1.1 (headers + Content-Length) to answer."""

    def connection_made(self, transport):
        self.t, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            self.buf = self.buf[end + 4 + n:]
            self.t.write(RESPONSE)


def _serve(ports, cpu, ready):
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main():
        loop = asyncio.get_running_loop()
        for p in ports:
            await loop.create_server(_Responder, "127.0.0.1", p, backlog=8192)
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())



class _Eng:
    def __init__(self, name, port):
        self.name, self.url, self.api_key = name, f"http://127.0.0.1:{port}", "bench-key"


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Record:
    """What slime keeps of one answer (slime.utils.types.Sample.append_response_tokens: tokens, response length,
    loss mask, rollout logprobs, response text), filled as slime's generate fills it."""
    __slots__ = ("tokens", "response_length", "loss_mask", "rollout_log_probs", "response")

    def __init__(self, prompt_ids):
        self.tokens, self.response_length, self.loss_mask = list(prompt_ids), 0, []
        self.rollout_log_probs, self.response = [], ""

    def append(self, output: dict) -> None:
        pairs = output["meta_info"]["output_token_logprobs"]   # slime's generate: [item[1] ...], [item[0] ...]
        tokens = [int(t) for t in [item[1] for item in pairs]]  # then _to_int_list / _to_float_list
        log_probs = [float(x) for x in [item[0] for item in pairs]]
        self.response += output["text"]
        self.tokens += tokens
        self.response_length += len(tokens)
        self.loss_mask += [1] * len(tokens)
        self.rollout_log_probs += log_probs


async def _direct(session, ports, groups, n, conc):
    """slime's shape: every request at once behind one semaphore of concurrency x engines, each answer kept as
    slime keeps it (`_Record`). Returns the run to time (its requests and records built)."""
    urls = [f"http://127.0.0.1:{p}/generate" for p in ports]
    sem, lat, rr = asyncio.Semaphore(conc * len(ports)), [], [0]
    records = [(f"{g}/{i}", _Record([1, 2, 3])) for g in range(groups) for i in range(n)]

    async def one(rid, rec):
        t = time.perf_counter()
        async with sem:
            rr[0] += 1
            async with session.post(urls[rr[0] % len(urls)], headers=auth_headers("bench-key"),
                                    json={"input_ids": rec.tokens, "sampling_params": {"max_new_tokens": 4},
                                          "return_logprob": True, "rid": rid}) as r:
                rec.append(await r.json())
        lat.append(time.perf_counter() - t)

    async def go():
        await asyncio.gather(*(one(rid, rec) for rid, rec in records))
        assert all(rec.response_length == 4 for _, rec in records)
        return lat
    return go


async def _manager(client, ports, groups, n, conc):
    """The same requests through Dispatcher.run (one task per sample, as RolloutManager.rollout runs them).
    Returns the run to time (the dispatcher, its engines and the samples built: the manager builds them once)."""
    from rollout.dispatch import Dispatcher, Sample
    d = Dispatcher(client, {"max_new_tokens": 4}, capacity=conc)
    for i, p in enumerate(ports):
        await d.admit(_Eng(f"e{i}", p))
    samples = [Sample(f"g{g}/{i}", f"g{g}", i, [1, 2, 3]) for g in range(groups) for i in range(n)]

    async def go():
        await asyncio.gather(*(d.run(s) for s in samples))
        assert all(s.status == "truncated" and len(s.response_ids) == 4 for s in samples)
        return [s.t_done - s.t_submit for s in samples]
    return go


async def _bench(ports, groups, n, conc, rounds, batches=1):
    import aiohttp

    from rollout.engines.client import EngineClient
    out = {"direct": [], "manager": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session, EngineClient() as client:
        await (await _direct(session, ports, groups, n, conc))()  # warm up: open the connections
        await (await _manager(client, ports, groups, n, conc))()
        for r in range(rounds):  # a/b/b/a, so drift hits both sides alike
            order = ("direct", "manager") if r % 2 == 0 else ("manager", "direct")
            runs = {name: [0, 0.0, 0.0, []] for name in order}
            gc.collect()  # each round starts from the same heap: no collection debt left by the other side,
            gc.freeze()   # and what exists now is never scanned again in this round's collections
            for b in range(batches):  # a shallow shape: batch by batch a/b/b/a, so both sides see the same load
                for name in (order if b % 2 == 0 else order[::-1]):
                    fn = _direct if name == "direct" else _manager
                    go = await fn(session if name == "direct" else client, ports, groups, n, conc)
                    c0, t0 = time.process_time(), time.perf_counter()
                    lat = await go()
                    run = runs[name]
                    run[0] += len(lat)
                    run[1] += time.perf_counter() - t0
                    run[2] += time.process_time() - c0
                    run[3] += lat
            gc.unfreeze()
            for name in order:
                out[name].append(tuple(runs[name]))
    return out


def _summary(runs):
    reqs = sum(r[0] for r in runs)
    return reqs / sum(r[1] for r in runs), sum(r[2] for r in runs) / reqs, [x for r in runs for x in r[3]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=512, help="per engine (GLM-4.5 355B job: 512)")
    ap.add_argument("--groups", type=int, default=512, help="groups submitted at once (GLM-4.5 355B job: 512 x 8 = 4,096)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6, help="per side, alternated a/b/b/a")
    ap.add_argument("--low-inflight", type=int, default=32, help="a second, shallow run for per-request latency")
    ap.add_argument("--low-batches", type=int, default=64, help="shallow batches per round, back to back")
    a = ap.parse_args()

    ports = [free_port() for _ in range(a.engines)]
    ready = mp.Event()
    cpus = sorted(os.sched_getaffinity(0))
    srv = mp.Process(target=_serve, args=(ports, cpus[-1], ready), daemon=True)
    srv.start()
    try:
        if not ready.wait(60):
            sys.exit("error: the loopback responder did not start within 60 s")
        os.sched_setaffinity(0, {cpus[0]})  # the client side: one core
        try:
            import uvloop
            uvloop.install()
            loop_name = "uvloop"
        except ImportError:
            loop_name = "asyncio"
        low_conc = max(1, a.low_inflight // a.engines)
        shapes = [("seed", a.groups, a.concurrency, 1),
                  ("shallow", a.low_inflight // a.group_size, low_conc, a.low_batches)]
        out = [(key, g, c, b, asyncio.run(_bench(ports, g, a.group_size, c, a.rounds, b))) for key, g, c, b in shapes]
    finally:
        srv.terminate()
        srv.join(5)
    print(f"dispatcher scale: {a.engines} stand-in engines (minimal loopback HTTP responder, benchmark-only), "
          f"client on 1 core ({loop_name}), {a.rounds} rounds per side a/b/b/a")
    for key, groups, conc, batches, res in out:
        (d_rate, d_cpu, dl), (m_rate, m_cpu, ml) = _summary(res["direct"]), _summary(res["manager"])
        print(f"  {key}: {groups} groups x {a.group_size} submitted at once, {conc} per engine "
              f"({min(groups * a.group_size, conc * a.engines)} on the wire)"
              + (f", {batches} such batches back to back per round" if batches > 1 else ""))
        print(f"    {'':8s} {'req/s':>8s} {'CPU ms/req':>11s} {'p50 ms':>9s} {'p99 ms':>9s}")
        for name, rate, cpu, lat in (("direct", d_rate, d_cpu, dl), ("manager", m_rate, m_cpu, ml)):
            print(f"    {name:8s} {rate:8.0f} {cpu * 1e3:11.3f} {_pct(lat, 0.5) * 1e3:9.2f} {_pct(lat, 0.99) * 1e3:9.2f}")
        print(f"    manager adds: {(m_cpu - d_cpu) * 1e3:+.3f} ms CPU per request; latency p50 "
              f"{(_pct(ml, 0.5) - _pct(dl, 0.5)) * 1e3:+.2f} ms, p99 {(_pct(ml, 0.99) - _pct(dl, 0.99)) * 1e3:+.2f} ms"
              + ("  (at this depth latency is mostly queueing)" if groups * a.group_size > 256 else ""))
        print(f"    wall requests/s manager / direct: {m_rate / d_rate:.2f}x (shared machine: load moves this)")
        pairs = sorted((d[2] / d[0]) / (m[2] / m[0]) for d, m in zip(res["direct"], res["manager"]))
        judge("dispatcher_scale", f"{key}_req_per_cpu_s", pairs[len(pairs) // 2])
    return finish()


if __name__ == "__main__":
    sys.exit(main())
