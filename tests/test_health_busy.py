"""Health monitor: busy is not dead (sglang#22511), hung still is.

Stand-in (a fake, named as such): an aiohttp server answering `/health_generate` 503 after its
window and `/v1/loads` with SGLang 0.5.23's core fields, the snapshot advancing (a scheduler that
iterates: 0.5.23 publishes after every prefill batch) or frozen (a stopped scheduler: the HTTP
server still answers from the last published snapshot). The answers' shape and the 503 are recorded
from the real CPU engine in `test_health_busy_engine.py`, which runs the same monitor on it.
"""
import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from aiohttp import web
from support.fake_sglang import FakeSGLang

from support.engines import RemoteEngine
from rollout.engines.client import EngineClient
from rollout.engines.health import HealthMonitor, http_probe, scheduler_cpu


def _loads(ts, busy_us):  # the core fields of a real 0.5.23 /v1/loads answer (one DP rank)
    return {"timestamp": "2026-11-30T12:00:00+00:00", "version": "0.5.23", "accelerator": None,
            "num_accelerators": 1, "loads": [{
                "timestamp": ts, "dp_rank": 0, "num_running_reqs": 16, "num_waiting_reqs": 0,
                "num_waiting_uncached_tokens": 0, "num_used_tokens": 30400, "num_total_tokens": 30400,
                "num_active_tokens": 30400, "max_total_num_tokens": 40000, "max_running_requests": 2048,
                "token_usage": 0.76, "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.0,
                "total_prefill_uncached_tokens": busy_us // 100, "total_prefill_busy_us": busy_us}]}


async def _monitor(mode, run_s=1.5, failures=2):
    state = {"busy_us": 0}

    async def health(request):
        await asyncio.sleep(0.2)  # SGLang waits its window, then 503
        return web.Response(status=503)

    async def loads(request):
        if mode == "busy":
            state["busy_us"] += 1000
        return web.json_response(_loads(1000.0 + state["busy_us"], state["busy_us"]))

    server = await FakeSGLang({"/health_generate": health, "/v1/loads": loads}).serve()
    dead = []

    async def on_dead(engine, reason):
        dead.append((time.monotonic(), reason))

    try:
        async with EngineClient() as s:
            m = HealthMonitor(http_probe(s, 5), on_dead, interval_s=0.05, failures=failures, alive_poll_s=0.02)
            eng = RemoteEngine(server.url)
            t0 = time.monotonic()
            m.watch(eng)
            m.start()
            while time.monotonic() - t0 < run_s and not dead:
                await asyncio.sleep(0.05)
            history = list(m.history)  # a probe still in flight would see the session closed
            await m.stop()
            return history, [(t - t0, r) for t, r in dead]
    finally:
        await server.cleanup()


@pytest.mark.timeout(60)
def test_busy_engine_is_never_declared_dead():
    history, dead = asyncio.run(_monitor("busy"))
    assert dead == [], dead
    assert len(history) >= 3 and all(ok and d.startswith("busy (HTTP 503") for _, ok, d in history), history


@pytest.mark.timeout(60)
def test_hung_engine_declared_dead_within_budget():
    history, dead = asyncio.run(_monitor("hung"))
    assert len(dead) == 1, history
    t, reason = dead[0]
    assert "2 consecutive health probes failed (last: HTTP 503; no progress during the probe)" in reason
    assert t < 2 * (0.05 + 0.2 + 0.2) + 0.5  # failures x (interval + probe) plus scheduling slack


@pytest.mark.timeout(60)
def test_scheduler_cpu_sees_work_and_sigstop():
    """A local process tree: CPU seconds of processes named like SGLang's schedulers, and stopped state
    (the real names, `sglang::scheduler...`, are checked on the real engine)."""
    code = ("open('/proc/self/comm','w').write('scheduler_TP0')\n"
            "import time\nwhile True: sum(range(10000))\n")
    # a parent of its own: only its tree counts (not another test's engine still stopping under pytest)
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, "
                               "'-c', sys.argv[1]])", code], start_new_session=True)
    eng = type("Local", (), {"backend": "local", "pid": parent.pid})()
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = psutil.Process(parent.pid).children()
        time.sleep(1.0)
        cpu0, stopped0 = scheduler_cpu(eng)
        time.sleep(0.5)
        cpu1, _ = scheduler_cpu(eng)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.3)
        cpu2, stopped2 = scheduler_cpu(eng)
        time.sleep(0.5)
        cpu3, _ = scheduler_cpu(eng)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert cpu0 is not None and cpu1 > cpu0 and not stopped0
    assert stopped2 and cpu3 == cpu2
    assert scheduler_cpu(RemoteEngine("http://x")) == (None, False)
