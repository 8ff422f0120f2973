"""sglang#35884 on the REAL CPU engine: probes the client gave up on stay held by SGLang, and a monitor
that probes again piles them up; with the one-probe rule (`HealthMonitor.server_window_s`) SGLang holds
at most one. Slow: starts one engine, runs one long unchunked prefill twice.

SGLang's `/health_generate` holds each probe for its window (`SGLANG_HEALTH_CHECK_TIMEOUT`, 2 s here)
and, when no scheduler output arrived meanwhile (one forward longer than the window), logs
"Health check failed ... tic start time: HH:MM:SS" at its end. Each such line is a probe SGLang held
for the whole window; their start times give how many it held at once. The monitor probes with a
0.3 s client timeout (a client that gives up long before SGLang does, as the shipped tiny-cpu-dpattn
config's 10 s does against the default 20 s window). The prefill must finish either way (on CPU the
pile-up does not crash it; on GPU sglang#35884 reports a paged-prefill crash from batched probes).
"""
import asyncio
import random
import re
import threading
import time
from datetime import datetime

import aiohttp
import pytest
import requests

from support.engines import log_text, preset
from rollout.engines.health import HealthMonitor, http_probe
from rollout.net import auth_headers

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]
N_PROMPTS, PROMPT_LEN, WINDOW_S = 96, 1900, 2
ATTEMPTS = 3  # bursts per mode until one prefill outlasts two windows
FAILED = re.compile(r"Health check failed\. .*tic start time: (\d\d:\d\d:\d\d)")


class Handle:
    backend = "ray"  # the probe sees only HTTP: no CPU-progress pass, every held probe fails

    def __init__(self, eng):
        self.name, self.url, self.api_key = "hp", eng.url, eng.api_key
        self.eng = eng

    def alive(self):
        return self.eng.alive()

    def exit_reason(self):
        return "exited"


@pytest.fixture(scope="module")
def engine(engine_pool, tiny_model):
    total = N_PROMPTS * PROMPT_LEN + 2048
    spec = preset("a", tiny_model, routed_experts=False, chunked_prefill_size=-1,
                  args={"max_total_tokens": total, "max_prefill_tokens": total, "context_length": 2048},
                  env={"SGLANG_HEALTH_CHECK_TIMEOUT": str(WINDOW_S)})
    return engine_pool.get("health-pileup", spec)


def _burst(eng, seed, out):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 300) for _ in range(PROMPT_LEN)] for _ in range(N_PROMPTS)]  # no cached prefix

    def one(i):
        ids = prompts[i]
        r = requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), timeout=900,
                          json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        good = r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] in ("length", "stop")  # EOS
        out.append(True if good else f"HTTP {r.status_code}: {r.text[:300]}")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_PROMPTS)]
    for t in threads:
        t.start()
    return threads


def _held_at_once(text: str, since: int) -> tuple:
    """(probes SGLang held for its whole window, the most it held at one time) from log lines after `since`."""
    starts = [datetime.strptime(m.group(1), "%H:%M:%S") for m in FAILED.finditer(text[since:])]
    secs = sorted(s.hour * 3600 + s.minute * 60 + s.second for s in starts)
    most = max((sum(1 for u in secs if t <= u < t + WINDOW_S) for t in secs), default=0)
    return len(secs), most


def _run(engine, seed, server_window_s):
    since = len(log_text(engine))
    ok = []

    async def go():
        async with aiohttp.ClientSession() as s:
            m = HealthMonitor(http_probe(s, 0.3), lambda e, r: asyncio.sleep(0), interval_s=0.2, failures=10**6,
                              alive_poll_s=0.05, server_window_s=server_window_s)
            m.watch(Handle(engine))
            m.start()
            threads = _burst(engine, seed, ok)
            t0 = time.monotonic()
            while any(t.is_alive() for t in threads):
                await asyncio.sleep(0.2)
            took = time.monotonic() - t0
            await m.stop()
            return list(m.history), took

    history, took = asyncio.run(go())
    time.sleep(WINDOW_S + 1.5)  # the last held probes end and log
    held, most = _held_at_once(log_text(engine), since)
    print(f"server_window_s={server_window_s}: prefill {took:.1f} s, {len(history)} probes, "
          f"SGLang held {held} for its whole window, at most {most} at once; prefill ok {ok.count(True)}/{len(ok)}"
          + "".join(f"\n  failed: {x}" for x in ok if x is not True))
    return history, took, held, most, ok


def _long_run(engine, seed, server_window_s):
    """_run until the prefill outlasts two windows (a loaded machine is slower, never faster, than needed)."""
    for attempt in range(ATTEMPTS):
        out = _run(engine, seed + 10 * attempt, server_window_s)
        if out[1] > 2 * WINDOW_S:
            return out
    pytest.fail(f"no prefill outlasted two {WINDOW_S} s windows in {ATTEMPTS} bursts: nothing to show")


def test_held_probes_pile_up_without_the_rule_and_not_with_it(engine):
    _run(engine, 0, server_window_s=0.0)  # warm-up: the first large forward also compiles
    _, _, held1, most1, ok1 = _long_run(engine, 1, server_window_s=WINDOW_S + 0.5)
    assert held1 >= 1 and most1 == 1, f"with the rule: held {held1}, most {most1} at once"
    _, _, held0, most0, ok0 = _long_run(engine, 2, server_window_s=0.0)
    assert most0 >= 3, f"without the rule SGLang should hold several probes at once (held {held0}, most {most0})"
    assert ok1 == [True] * N_PROMPTS, f"with the rule the prefill did not survive: {set(ok1) - {True}}"
    assert ok0 == [True] * N_PROMPTS, f"without the rule the prefill did not survive: {set(ok0) - {True}}"
    r = requests.get(engine.url + "/health_generate", headers=auth_headers(engine.api_key), timeout=60)
    assert r.status_code == 200
