"""Readiness reaches every DP rank of a REAL DP-attention engine (SGLang 0.5.23 on CPU, `make test`).

The lightest engine with two DP ranks: the tiny GLM-4.5, tp 2 / dp 2 with DP attention, nothing else.
Its `/server_info` says dp_size 1 (attn_dp_size 2), so a probe count read from dp_size alone would
reach rank 0 only; the test proves from the per-rank answers that both ranks served their probe.
"""
import asyncio
import json
import os
import time

import pytest

from rollout.engines.client import EngineClient
from rollout import config as rconfig
from rollout.cli.engine import model_for
from rollout.engines.local_backend import LocalBackend
from rollout.engines.process import cpu_percent
from rollout.engines.readiness import wait_ready
from rollout.net import free_port
from support.engines import two_rank_dp

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]  # one engine start (2-6 min on a loaded 2-core box)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec():
    cfg = rconfig.load(os.path.join(ROOT, "training_configs", "tiny-cpu-dpattn.yaml"))
    two_rank_dp(cfg.engine_groups[0]).routed_experts = False
    for k in ("http_s", "server_up_s", "health_generate_s", "dp_probe_s"):
        setattr(cfg.rollout.budgets, k, 600.0)
    spec = rconfig.engine_specs(cfg, model_for(cfg, ROOT), ports=[free_port()])[0]
    return cfg, spec


@pytest.fixture(scope="module")
def ready_engine(tmp_path_factory):
    """One engine for both tests: started, admitted by readiness, stopped (no process left) at the end."""
    cfg, spec = _spec()
    eng = LocalBackend(str(tmp_path_factory.mktemp("dp-engine"))).start(spec)

    async def go():
        async with EngineClient() as s:
            info = await wait_ready(eng, cfg.rollout.budgets, s)
            return info, await s.server_info(eng, 60)

    try:
        yield eng, asyncio.run(go())
    finally:
        eng.stop()
    assert eng.leftover_pids() == []


def test_every_dp_attention_rank_answers_its_own_probe(ready_engine):
    eng, (info, server_info) = ready_engine
    with open(os.path.join(ROOT, "tests", "facts", "sglang-0.5.23-dp-attn.json")) as fh:
        recorded = json.load(fh)["server_info"]
    # the engine still answers as recorded (the stand-ins in test_readiness.py answer the recording)
    assert {k: server_info.get(k) for k in ("dp_size", "attn_dp_size", "enable_dp_attention")} == \
        {k: recorded[k] for k in ("dp_size", "attn_dp_size", "enable_dp_attention")} == \
        {"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}
    assert info.dp_size == 2
    assert info.rank_answers == {0: 0, 1: 1}  # each probe was served by the rank it was pinned to


def test_idle_dp_controller_sleeps(ready_engine):
    """With --sleep-on-idle (the CPU profile) no process of the idle engine spins, the DP controller
    included: SGLang's own DataParallelController.event_loop busy-polls unless cpu-dp-controller-idle."""
    eng, _ = ready_engine
    assert "--sleep-on-idle" in eng.procs[0].argv
    time.sleep(2)  # settle after the readiness probes
    rows = cpu_percent(eng.tree_pids(), 5.0)
    table = "; ".join(f"{title.split()[0]} {pct:.0f}%" for title, pct in sorted(rows.values()))
    ctl = [pct for title, pct in rows.values() if "data_parallel_controller" in title]
    assert len(ctl) == 1, f"no single DP controller among the engine's processes: {table}"
    assert ctl[0] < 10, f"idle DP controller busy-polls at {ctl[0]:.0f}% of a core (all processes: {table})"
    assert all(pct < 20 for _, pct in rows.values()), f"an idle process burns CPU: {table}"
