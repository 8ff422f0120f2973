"""Busy is not dead, on the REAL CPU engine (sglang#22511). Slow: starts one engine.

SGLang answers `/health_generate` 503 when no scheduler output reached the HTTP server within its
window (`SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s; 1 s here), so ONE forward longer than the window fails
it. The tests do not rely on the machine being slow enough for that: a request carrying
`held_forward.HeldForward` keeps the scheduler inside its forward step, burning CPU, until the test
releases it. Shown: the stock answer while only busy (503); during one held step, a monitor without
the progress rule (every failed probe counts) declares the engine dead, while the monitor with
`http_probe` keeps it as "busy"; a SIGSTOPped scheduler is declared dead within failures x (interval +
probe).
"""
import asyncio
import os
import time

import pytest
import requests
from support.engines import preset
from held_forward import held_forward

from rollout.engines.client import EngineClient
from rollout.engines.health import HealthMonitor, http_probe, scheduler_cpu
from rollout.net import auth_headers

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]
TESTS = os.path.dirname(os.path.abspath(__file__))
INTERVAL_S, FAILURES = 0.5, 2


@pytest.fixture(scope="module")
def engine(engine_pool, tiny_model):
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    spec = preset("a", tiny_model, args={"enable_custom_logit_processor": True},
                  env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1", "PYTHONPATH": path})
    return engine_pool.get("health-busy", spec)


def _health(engine) -> int:
    return requests.get(engine.url + "/health_generate", headers=auth_headers(engine.api_key), timeout=60).status_code


def _healthy_again(engine, budget_s: float = 120.0) -> bool:
    """/health_generate 200 within the budget (its one-token probe may itself outlast 1 s on a slow machine)."""
    end = time.monotonic() + budget_s
    while time.monotonic() < end:
        if _health(engine) == 200:
            return True
    return False


def test_stock_health_generate_fails_while_only_busy(engine, tmp_path):
    with held_forward(engine, tmp_path):
        busy = _health(engine)
    assert busy == 503, f"/health_generate answered {busy} while the scheduler was inside one long forward"
    assert _healthy_again(engine)


class Handle:
    """The monitor's view of the pool's engine, under another name per monitor."""

    def __init__(self, eng, name):
        self.eng, self.name, self.url, self.api_key, self.pid = eng, name, eng.url, eng.api_key, eng.pid
        self.backend = eng.backend

    def alive(self):
        return self.eng.alive()

    def exit_reason(self):
        return self.eng.exit_reason()


def _without_rule(client):
    """The probe without the progress rule: every answer but 200 is a failure (the stock monitor)."""
    async def probe(engine):
        await client.health_generate(engine, 30)   # raises on anything but 200
    return probe


def test_monitor_keeps_busy_engine_and_kills_stopped_one(engine, tmp_path):
    async def go():
        dead = []

        async def on_dead(e, reason):
            dead.append((e.name, time.monotonic(), reason))

        async with EngineClient() as s:
            ruled = HealthMonitor(http_probe(s, 30), on_dead, interval_s=INTERVAL_S, failures=FAILURES)
            stock = HealthMonitor(_without_rule(s), on_dead, interval_s=INTERVAL_S, failures=FAILURES)
            ruled.watch(Handle(engine, "with-rule"))
            stock.watch(Handle(engine, "without-rule"))
            ruled.start()
            stock.start()
            with held_forward(engine, tmp_path):   # one forward step, held until both monitors have seen it
                end = time.monotonic() + 90
                busy = lambda: [d for _, ok, d in ruled.history if ok and d.startswith("busy (HTTP 503")]
                while (len(busy()) < FAILURES + 1 or not dead) and time.monotonic() < end:
                    await asyncio.sleep(0.2)
                held = list(ruled.history), list(dead)
            await stock.stop()
            assert await asyncio.to_thread(_healthy_again, engine)
            procs = _schedulers(engine)
            for p in procs:
                p.suspend()
            t_stop = time.monotonic()
            try:
                while len(dead) < 2 and time.monotonic() - t_stop < 60:
                    await asyncio.sleep(0.2)
            finally:
                for p in procs:
                    p.resume()
            await ruled.stop()
            return held, dead, t_stop

    (history, dead_while_held), dead, t_stop = asyncio.run(go())
    print("while held:", history, dead_while_held)
    print("after SIGSTOP:", dead)
    assert [n for n, _, _ in dead_while_held] == ["without-rule"], \
        f"the held step must fail the monitor without the rule, and only it: {dead_while_held}"
    busy = [d for _, ok, d in history if ok and d.startswith("busy (HTTP 503")]
    assert len(busy) >= FAILURES + 1, f"the monitor with the rule never met the busy engine: {history}"
    assert all(ok for _, ok, _ in history), f"a probe failed while the engine was only busy: {history}"
    stopped = [(t, r) for n, t, r in dead if n == "with-rule"]
    assert stopped and "health probes failed" in stopped[0][1], dead
    assert stopped[0][0] - t_stop < FAILURES * (INTERVAL_S + 1 + 5) + 5
    assert _healthy_again(engine)


def _schedulers(engine):
    import psutil

    procs = [p for p in psutil.Process(engine.pid).children(recursive=True) if "scheduler" in p.name()]
    assert procs and scheduler_cpu(engine)[0] is not None, "no scheduler process found by name"
    return procs
