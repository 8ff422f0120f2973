"""Dispatcher: an attempt cancelled by remove() is re-sent; any other cancellation of the caller propagates.

The attempt runs inside the caller's task (no task per request, for speed), so these pin the two
cancellations apart. Engines are the fake SGLang server (tests/support/fake_sglang.py), one hanging.
"""
import asyncio

import aiohttp
import pytest
from aiohttp import web
from support.fake_sglang import FakeSGLang, answer

from rollout.dispatch import Dispatcher
from rollout.types import Sample

BODY = dict(answer([7], {"type": "length", "length": 1}, logprob=-0.5), text="")


class _Eng:
    def __init__(self, name, port):
        self.name, self.url, self.api_key = name, f"http://127.0.0.1:{port}", "k"


async def _server(hang: bool):
    got = asyncio.Event()

    async def generate(request):
        await request.json()
        got.set()
        if hang:
            await asyncio.sleep(3600)
        return web.json_response(BODY)

    server = await FakeSGLang({"/generate": generate}, shutdown_timeout=0.5).serve()
    return server.runner, server.port, got


@pytest.mark.timeout(60)
def test_removed_engine_attempt_is_resent_and_outside_cancel_propagates():
    async def main():
        r1, p1, got1 = await _server(hang=True)
        r2, p2, _ = await _server(hang=False)
        try:
            async with aiohttp.ClientSession() as session:
                d = Dispatcher(session, {"max_new_tokens": 1}, capacity=1)
                hang, ok = _Eng("hang", p1), _Eng("ok", p2)
                await d.admit(hang)
                s = Sample("g/0", "g", 0, [1, 2])
                run = asyncio.create_task(d.run(s))
                await asyncio.wait_for(got1.wait(), 10)
                await d.admit(ok)
                assert await d.remove(hang) == 1
                out = await asyncio.wait_for(run, 10)
                assert (out.status, out.engines, out.attempts, d.resent) == ("truncated", ["hang", "ok"], 2, 1)
                assert out.response_ids == [7] and d.outstanding() == {"ok": 0}

                # the caller itself is cancelled while its attempt hangs: CancelledError, not a re-send
                got1.clear()
                await d.admit(_Eng("hang", p1))
                await d.remove(ok)
                s2 = Sample("g/1", "g", 1, [1, 2])
                run2 = asyncio.create_task(d.run(s2))
                await asyncio.wait_for(got1.wait(), 10)
                run2.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await run2
                assert s2.attempts == 1 and d.resent == 1 and d.outstanding() == {"hang": 0}
        finally:
            await r1.cleanup()
            await r2.cleanup()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_waiters_get_slots_in_order_and_wake_when_a_suspect_pause_ends():
    """No polling: a released slot wakes the oldest waiter; a slot paused after a connection error
    wakes the waiters when its pause ends (one timer)."""
    async def main():
        runner, port, _ = await _server(hang=False)
        try:
            async with aiohttp.ClientSession() as session:
                d = Dispatcher(session, {"max_new_tokens": 1}, capacity=1)
                await d.admit(_Eng("ok", port))
                samples = [Sample(f"g/{i}", "g", i, [1, 2]) for i in range(6)]
                done = await asyncio.gather(*(d.run(s) for s in samples))
                assert [s.status for s in done] == ["truncated"] * 6
                assert sorted(samples, key=lambda s: s.t_done) == samples  # FIFO
                assert not d._waiters

                # the only engine answers with a connection error once: paused 1 s, then used again
                from rollout.net import free_port
                bad = _Eng("flaky", free_port())
                d2 = Dispatcher(session, {"max_new_tokens": 1}, capacity=1)
                await d2.admit(bad)
                s = Sample("h/0", "h", 0, [1, 2])
                t = asyncio.create_task(d2.run(s))
                while not d2.resent:
                    await asyncio.sleep(0.01)
                bad.url = f"http://127.0.0.1:{port}"  # the engine is back
                out = await asyncio.wait_for(t, 10)
                assert out.status == "truncated" and out.attempts == 2 and d2._timer is None
        finally:
            await runner.cleanup()

    asyncio.run(main())
