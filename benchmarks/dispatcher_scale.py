"""Dispatcher overhead at the seed job's scale: 4 engines, 4,096 requests in flight.

Planned for the 128-GPU job (4 engines x 32 GPUs, e.g. 512 prompts x 8 samples in flight). The
engines are replaced by a MINIMAL LOOPBACK HTTP RESPONDER (a benchmark-only stand-in, not SGLang):
it answers every POST /generate at once with a fixed 4-token body, so what is measured is the
manager's own cost. The dispatcher runs pinned to one core, the responder on another.

Printed, side by side in one run, at 4,096 and at 32 requests in flight: requests/s and per-request
latency (p50/p99) through `rollout.dispatch.Dispatcher` vs a bare aiohttp client with the same
concurrency against the same responder; the ratio of requests/s, the manager's CPU per request, and
the latency it adds (meaningful at the shallow depth; at 4,096 latency is queueing).
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


async def _direct(session, urls, total, inflight):
    """Baseline: `inflight` closed-loop workers posting straight to the responders (round-robin)."""
    lat, per = [], max(1, total // inflight)

    async def worker(w):
        for k in range(per):
            t = time.perf_counter()
            async with session.post(urls[(w + k) % len(urls)] + "/generate",
                                    json={"input_ids": [1, 2, 3], "return_logprob": True, "rid": f"{w}/{k}"},
                                    headers={"Authorization": "Bearer bench-key"}) as r:
                await r.json()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return per * inflight / (time.perf_counter() - t0), lat


async def _manager(session, ports, total, inflight):
    """The same load through Dispatcher.run (routing, bounded slots, payload, response parsing)."""
    from rollout.dispatch import Dispatcher, Sample
    d = Dispatcher(session, {"max_new_tokens": 4}, capacity=inflight // len(ports))
    for i, p in enumerate(ports):
        await d.admit(_Eng(f"e{i}", p))
    lat, per = [], max(1, total // inflight)

    async def worker(w):
        for k in range(per):
            s = Sample(f"g{w}-{k}/0", f"g{w}-{k}", 0, [1, 2, 3])
            t = time.perf_counter()
            await d.run(s)
            lat.append(time.perf_counter() - t)
            assert s.status == "truncated" and len(s.response_ids) == 4

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return per * inflight / (time.perf_counter() - t0), lat


async def _bench(ports, total, inflight, rounds):
    import aiohttp
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    out = {"direct": ([], []), "manager": ([], [])}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _direct(session, urls, inflight, inflight)  # warm up: open the connections
        for _ in range(rounds):  # interleaved, so drift hits both sides alike
            for name, fn in (("direct", _direct), ("manager", _manager)):
                rate, lat = await fn(session, urls if name == "direct" else ports, total, inflight)
                out[name][0].append(rate)
                out[name][1].extend(lat)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--low-inflight", type=int, default=32, help="a second, shallow run for per-request latency")
    a = ap.parse_args()
    from rollout.engines.engine_launch import free_port

    ports = [free_port() for _ in range(a.engines)]
    ready = mp.Event()
    cpus = sorted(os.sched_getaffinity(0))
    srv = mp.Process(target=_serve, args=(ports, cpus[-1], ready), daemon=True)
    srv.start()
    try:
        ready.wait(30)
        os.sched_setaffinity(0, {cpus[0]})  # the dispatcher side: one core
        try:
            import uvloop
            uvloop.install()
            loop_name = "uvloop"
        except ImportError:
            loop_name = "asyncio"
        out = [(n, asyncio.run(_bench(ports, max(a.requests, 4 * n), n, a.rounds)))
               for n in (a.inflight, a.low_inflight)]
    finally:
        srv.terminate()
        srv.join(5)
    print(f"dispatcher scale: {a.engines} stand-in engines (minimal loopback HTTP responder, benchmark-only), "
          f"client on 1 core ({loop_name}), {a.rounds} interleaved rounds per side")
    for inflight, res in out:
        d_rate = sum(res["direct"][0]) / len(res["direct"][0])
        m_rate = sum(res["manager"][0]) / len(res["manager"][0])
        dl, ml = res["direct"][1], res["manager"][1]
        print(f"  {inflight} requests in flight:")
        print(f"    {'':8s} {'req/s':>8s} {'p50 ms':>9s} {'p99 ms':>9s}")
        for name, rate, lat in (("direct", d_rate, dl), ("manager", m_rate, ml)):
            print(f"    {name:8s} {rate:8.0f} {_pct(lat, 0.5) * 1e3:9.2f} {_pct(lat, 0.99) * 1e3:9.2f}")
        print(f"    manager / direct requests/s: {m_rate / d_rate:.2f}x; manager CPU per request: "
              f"{(1 / m_rate - 1 / d_rate) * 1e3:+.3f} ms of one core")
        print(f"    latency added by the manager: p50 {(_pct(ml, 0.5) - _pct(dl, 0.5)) * 1e3:+.2f} ms, "
              f"p99 {(_pct(ml, 0.99) - _pct(dl, 0.99)) * 1e3:+.2f} ms"
              + ("  (at this depth latency is queueing: in-flight / rate)" if inflight > 256 else ""))

if __name__ == "__main__":
    main()
