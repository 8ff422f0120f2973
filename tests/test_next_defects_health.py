"""sglang#35884: a `/health_generate` probe the client gave up on is not aborted by SGLang; a monitor that
probes again adds a second one beside it (probes pile up). The monitor keeps one probe per engine counted
as SGLang counts it: after a probe without an HTTP answer it waits out SGLang's window before the next.

Stand-in (a fake, named as such): an aiohttp server whose `/health_generate` answers as SGLang's does
while its scheduler is in one long forward: it holds every probe for its whole window, whether or not the
client is still there, then answers 503 (SGLang's handler polls `last_receive_tstamp` for
`SGLANG_HEALTH_CHECK_TIMEOUT` seconds and never looks at the connection). It counts the probes it holds.
The real engine run is `test_next_defects_health_engine.py`.
"""
import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from support.fake_sglang import FakeSGLang

from support.engines import RemoteEngine
from rollout.engines.health import NO_ANSWER, HealthMonitor, http_probe

pytestmark = pytest.mark.timeout(60)
WINDOW_S = 1.0


async def _held_probes(server_window_s, hold_s, run_s=3.0, enough=None):
    """Probe the stand-in for `run_s` (or until `enough(held)`, at most 30 s); each probe is held for
    `hold_s` or until the run ends, whichever is first."""
    held = {"now": 0, "max": 0, "seen": 0}
    done = asyncio.Event()

    async def health(request):
        held["now"] += 1
        held["seen"] += 1
        held["max"] = max(held["max"], held["now"])
        try:
            await asyncio.wait_for(done.wait(), hold_s)
        except asyncio.TimeoutError:
            pass
        finally:
            held["now"] -= 1
        return web.Response(status=503)

    async def loads(request):
        return web.Response(status=404)  # no progress signal: every probe fails

    server = await FakeSGLang({"/health_generate": health, "/v1/loads": loads},
                              handler_cancellation=False).serve()  # SGLang's handler outlives its client
    url = server.url
    try:
        async with aiohttp.ClientSession() as s:
            m = HealthMonitor(http_probe(s, 0.2), lambda e, r: asyncio.sleep(0), interval_s=0.1, failures=1000,
                              alive_poll_s=0.02, server_window_s=server_window_s)
            m.watch(RemoteEngine(url))
            m.start()
            t0 = time.monotonic()
            while time.monotonic() - t0 < (30.0 if enough else run_s) and not (enough and enough(held)):
                await asyncio.sleep(0.05)
            await m.stop()
            history = list(m.history)
    finally:
        done.set()  # the held handlers end before the server closes
        await asyncio.sleep(0.2)
        await server.cleanup()
    return held, history


def test_probe_without_answer_holds_the_engine_slot_for_sglangs_window():
    # SGLang's handler holds a probe for its window (here 1 s); the monitor counts 2 s: a wide margin
    held, history = asyncio.run(_held_probes(server_window_s=2 * WINDOW_S, hold_s=WINDOW_S))
    assert history and all(NO_ANSWER in d for _, ok, d in history), history
    assert held["max"] == 1, held
    assert held["seen"] <= 3, held  # one probe per 2 s window in 3 s


def test_without_the_rule_probes_pile_up():
    """The monitor before this change (server_window_s 0): a new probe every interval beside the held ones."""
    held, _ = asyncio.run(_held_probes(server_window_s=0.0, hold_s=60.0, enough=lambda h: h["max"] >= 3))
    assert held["max"] >= 3, held


def test_answered_probe_does_not_hold():
    """A 503 or 200 ended SGLang's handler: the next probe follows at the interval."""
    async def go():
        server = await FakeSGLang().serve()   # /health_generate answers 200 at once
        async with aiohttp.ClientSession() as s:
            m = HealthMonitor(http_probe(s, 5), lambda e, r: asyncio.sleep(0), interval_s=0.05, failures=3,
                              alive_poll_s=0.01, server_window_s=30)
            m.watch(RemoteEngine(server.url))
            m.start()
            t0 = time.monotonic()
            while len(m.history) < 5 and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            await m.stop()
        await server.cleanup()
        return list(m.history)

    history = asyncio.run(go())
    assert len(history) >= 5 and all(ok for _, ok, _ in history), history


def test_manager_passes_the_engines_health_window():
    """The monitor's server window is the largest SGLANG_HEALTH_CHECK_TIMEOUT an engine group sets (else 20 s)."""
    from types import SimpleNamespace

    from rollout.manager import RolloutManager

    def mgr(*envs):
        specs = {f"e{i}": SimpleNamespace(group=SimpleNamespace(env=env)) for i, env in enumerate(envs)}
        return SimpleNamespace(specs=specs)

    assert RolloutManager._server_health_window(mgr({}, {})) == 20.0
    assert RolloutManager._server_health_window(mgr({"SGLANG_HEALTH_CHECK_TIMEOUT": "45"}, {})) == 45.0
