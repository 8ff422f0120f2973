"""Busy is not dead, on the REAL CPU engine (sglang#22511). Slow: starts one engine.

SGLang 0.5.23 answers a busy scheduler's health probe after each forward, so `/health_generate`
fails only when ONE forward outlasts the window (`SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s; 1 s here):
a large unchunked prefill batch (`--chunked-prefill-size -1`, 24 prompts of 1900 tokens). The test
first shows the stock answer (503 while the engine is only busy: the monitor before this change
counted every 503), then runs the monitor with `http_probe` through the same prefill (never
declared dead, probes pass as "busy"), then SIGSTOPs the scheduler (declared dead within
failures x (interval + probe)).
"""
import asyncio
import threading
import time

import aiohttp
import pytest
import requests

from rollout.engines.engine_launch import EngineOptions
from rollout.engines.health import HealthMonitor, http_probe, scheduler_cpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
N_PROMPTS, PROMPT_LEN = 24, 1900
BUSY_ATTEMPTS = 4


class Handle:
    """The monitor's view of an EngineProcess (name, url, key, local pid)."""
    backend = "local"

    def __init__(self, eng):
        self.eng, self.name, self.url, self.api_key, self.pid = eng, "hb", eng.url, eng.api_key, eng.pid

    def alive(self):
        return self.eng.alive()

    def exit_reason(self):
        return f"exited {self.eng.popen.returncode}"


def _prefill_burst(eng, seed):
    def one(i):
        ids = [10 + (seed * 7919 + i * 131 + j * 17) % 180 for j in range(PROMPT_LEN)]
        requests.post(eng.url + "/generate", headers=eng.headers(), timeout=600,
                      json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_PROMPTS)]
    for t in threads:
        t.start()
    return threads


@pytest.fixture(scope="module")
def engine(engine_pool, tiny_model):
    opts = EngineOptions(model_path=tiny_model, max_total_tokens=N_PROMPTS * PROMPT_LEN + 2048,
                         extra_args=["--chunked-prefill-size", "-1", "--max-prefill-tokens",
                                     str(N_PROMPTS * PROMPT_LEN + 2048), "--context-length", "2048"],
                         env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"})
    return engine_pool.get("health-busy", opts)


def test_stock_health_generate_fails_while_only_busy(engine):
    threads = _prefill_burst(engine, 1)
    answers = []
    while any(t.is_alive() for t in threads):
        answers.append(requests.get(engine.url + "/health_generate", headers=engine.headers(), timeout=60).status_code)
    print("health answers during the burst:", answers)
    assert 503 in answers, f"one forward did not outlast the 1 s window: {answers}"
    assert requests.get(engine.url + "/health_generate", headers=engine.headers(), timeout=60).status_code == 200


def test_monitor_keeps_busy_engine_and_kills_stopped_one(engine):
    handle = Handle(engine)

    async def go():
        dead = []

        async def on_dead(e, reason):
            dead.append((time.monotonic(), reason))

        async with aiohttp.ClientSession() as s:
            m = HealthMonitor(http_probe(s, 30), on_dead, interval_s=0.5, failures=2)
            m.watch(handle)
            m.start()
            # A probe answers 503 only if it starts > 1 s before the forward in flight ends, so one burst
            # may slip between probes: burst again (bounded) until the monitor has met the busy engine.
            for attempt in range(BUSY_ATTEMPTS):
                threads = _prefill_burst(engine, 2 + attempt)
                while any(t.is_alive() for t in threads):
                    await asyncio.sleep(0.2)
                if any(d.startswith("busy (HTTP 503") for _, _, d in m.history):
                    break
                print(f"burst {attempt + 1}/{BUSY_ATTEMPTS}: no probe met the busy engine: {list(m.history)}")
            busy_history = list(m.history)
            procs = _schedulers(engine)
            for p in procs:
                p.suspend()
            t_stop = time.monotonic()
            try:
                while not dead and time.monotonic() - t_stop < 60:
                    await asyncio.sleep(0.2)
            finally:
                for p in procs:
                    p.resume()
            await m.stop()
            return busy_history, dead, t_stop

    busy_history, dead, t_stop = asyncio.run(go())
    print("busy phase:", busy_history)
    print("after SIGSTOP:", dead)
    assert not [d for d in dead if d[0] < t_stop], "declared dead while only busy"
    assert any(d.startswith("busy (HTTP 503") for _, ok, d in busy_history), busy_history
    assert dead and "health probes failed" in dead[0][1] and dead[0][0] - t_stop < 2 * (0.5 + 1 + 5) + 5
    assert requests.get(engine.url + "/health_generate", headers=engine.headers(), timeout=60).status_code == 200


def _schedulers(engine):
    import psutil

    procs = [p for p in psutil.Process(engine.pid).children(recursive=True) if "scheduler" in p.name()]
    assert procs and scheduler_cpu(Handle(engine))[0] is not None, "no scheduler process found by name"
    return procs
