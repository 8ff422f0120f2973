"""sglang#35884 on the REAL CPU engine: probes the client gave up on stay held by SGLang, and a monitor
that probes again piles them up; with the one-probe rule (`HealthMonitor.server_window_s`) SGLang holds
at most one. Slow: starts one engine.

SGLang's `/health_generate` holds each probe for its window (`SGLANG_HEALTH_CHECK_TIMEOUT`, 6 s here)
and, when no scheduler output arrived meanwhile, logs "Health check failed ... tic start time: HH:MM:SS"
at its end. Each such line is a probe SGLang held for the whole window; their start times give how many
it held at once. The test does not race a long prefill against the window (whether SGLang holds a probe
would then depend on the machine's speed): a request carrying `held_forward.HeldForward` keeps the
scheduler inside one forward step for `HOLD_WINDOWS` windows, whatever the machine's speed. The monitor
probes with a 0.3 s client timeout (a client that gives up long before SGLang does, as the shipped
tiny-cpu-dpattn config's 10 s does against the default 20 s window). The held request and a last
`/health_generate` must still succeed (on CPU the pile-up does not crash the engine; on GPU sglang#35884
reports a paged-prefill crash from batched probes).
"""
import asyncio
import os
import re
import time
from datetime import datetime

import pytest
import requests

from support.engines import log_text, preset
from held_forward import held_forward
from rollout.engines.client import EngineClient
from rollout.engines.health import HealthMonitor, http_probe
from rollout.net import auth_headers

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]
TESTS = os.path.dirname(os.path.abspath(__file__))
WINDOW_S = 6
HOLD_WINDOWS = 2.5   # the forward is held this many windows: room for several held probes
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
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    spec = preset("a", tiny_model, routed_experts=False, args={"enable_custom_logit_processor": True},
                  env={"SGLANG_HEALTH_CHECK_TIMEOUT": str(WINDOW_S), "PYTHONPATH": path})
    return engine_pool.get("health-pileup", spec)


def _held_at_once(text: str, since: int) -> tuple:
    """(probes SGLang held for its whole window, the most it held at one time) from log lines after `since`."""
    starts = [datetime.strptime(m.group(1), "%H:%M:%S") for m in FAILED.finditer(text[since:])]
    secs = sorted(s.hour * 3600 + s.minute * 60 + s.second for s in starts)
    most = max((sum(1 for u in secs if t <= u < t + WINDOW_S) for t in secs), default=0)
    return len(secs), most


def _run(engine, tmp_path, server_window_s):
    """Probe while one forward is held for HOLD_WINDOWS windows; what SGLang held, from its log."""
    since = len(log_text(engine))
    tmp_path.mkdir()

    async def go():
        async with EngineClient() as client:
            m = HealthMonitor(http_probe(client, 0.3), lambda e, r: asyncio.sleep(0), interval_s=0.2,
                              failures=10**6, alive_poll_s=0.05, server_window_s=server_window_s)
            m.watch(Handle(engine))
            with held_forward(engine, tmp_path):
                m.start()
                await asyncio.sleep(HOLD_WINDOWS * WINDOW_S)
                await m.stop()
            return list(m.history)

    history = asyncio.run(go())
    time.sleep(WINDOW_S + 1.5)  # the last held probes end and log
    held, most = _held_at_once(log_text(engine), since)
    print(f"server_window_s={server_window_s}: {len(history)} probes during a {HOLD_WINDOWS * WINDOW_S:g} s "
          f"held forward; SGLang held {held} for its whole window, at most {most} at once")
    return held, most


def test_held_probes_pile_up_without_the_rule_and_not_with_it(engine, tmp_path):
    held1, most1 = _run(engine, tmp_path / "with", server_window_s=WINDOW_S + 0.5)
    assert held1 >= 1 and most1 == 1, f"with the rule: held {held1}, most {most1} at once"
    held0, most0 = _run(engine, tmp_path / "without", server_window_s=0.0)
    assert most0 >= 3, f"without the rule SGLang should hold several probes at once (held {held0}, most {most0})"
    r = requests.get(engine.url + "/health_generate", headers=auth_headers(engine.api_key), timeout=60)
    assert r.status_code == 200
