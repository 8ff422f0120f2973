"""Per-replica liveness of plain `--dp-size` engines after admission (STAND-INS; the real engine:
tests/test_health_replicas_engine.py).

SGLang's `/health_generate` passes when any replica answers (0.5.23 `http_server.py`: any scheduler output
within the window is its answer; the DP controller round-robins the probe over the replicas), so a wedged
replica is invisible to it. The stand-in server answers as the real one does: `/health_generate` 200 (the
other replica answers), a `/generate` pinned with `routed_dp_rank` to the wedged replica never answers, its
`/v1/loads` entry frozen while the other's advances. The stand-in answers' shapes are SGLang 0.5.23's
(tests/facts/sglang-0.5.23-dp-plain.json: `/server_info`, the pinned one-token answer naming its rank).
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
from support.engines import RemoteEngine
from support.fake_sglang import FakeSGLang, answer, fact
from test_manager_standin import StandinBackend, make_manager, prompts

from rollout.engines.client import EngineClient
from rollout.engines.health import HealthMonitor, http_probe, per_replica, replica_probe, scheduler_cpu
from rollout.engines.readiness import plain_replicas
from rollout.engines.state import EngineTable
from rollout.stream import GroupStream
from rollout.types import EngineEvent

PLAIN = fact("dp-plain")["server_info"]
WEDGED = 1


def _loads(ticks: dict) -> dict:
    """/v1/loads of two replicas, SGLang 0.5.23's core fields; `ticks[rank]` moves a replica's snapshot."""
    return {"loads": [{"timestamp": 1000.0 + ticks[r], "dp_rank": r, "num_running_reqs": 1, "num_waiting_reqs": 0,
                       "num_used_tokens": 10, "total_prefill_busy_us": ticks[r], "total_prefill_uncached_tokens": 0}
                      for r in (0, 1)]}


def _server(replica_1: str):
    """A plain dp-2 engine whose replica 1 is `wedged` (no answer, snapshot frozen) or `busy` (no answer
    within the probe's timeout, snapshot advancing); replica 0 serves."""
    ticks = {0: 0, 1: 0}

    async def generate(request):
        body = await request.json()
        rank = body.get("routed_dp_rank")
        if rank == WEDGED:
            await asyncio.sleep(3600)
        return web.json_response(answer([3], {"type": "length", "length": 1}, dp_rank=rank))

    async def loads(request):
        ticks[0] += 1
        ticks[1] += replica_1 == "busy"
        return web.json_response(_loads(ticks))

    return FakeSGLang({"/generate": generate, "/v1/loads": loads}, server_info=PLAIN)


async def _watch(replica_1: str, wired: bool, run_s: float = 3.0):
    """Probe the stand-in with the fleet's probe (`wired`) or with `http_probe` alone (before per-replica
    probes); (history, deaths)."""
    server = await _server(replica_1).serve()
    dead = []

    async def on_dead(engine, reason):
        dead.append(reason)

    try:
        async with EngineClient() as client:
            probe = http_probe(client, 0.3)
            if wired:
                probe = per_replica(probe, replica_probe(client, 0.3), lambda e: 2)
            m = HealthMonitor(probe, on_dead, interval_s=0.05, failures=2, alive_poll_s=0.02)
            m.watch(RemoteEngine(server.url))
            m.start()
            end = time.monotonic() + run_s
            while time.monotonic() < end and not dead:
                await asyncio.sleep(0.05)
            history = list(m.history)
            await m.stop()
            return history, dead
    finally:
        await server.cleanup()


@pytest.mark.timeout(60)
def test_wedged_replica_passes_health_generate_and_fails_its_pinned_probe():
    history, dead = asyncio.run(_watch("wedged", wired=False))
    assert dead == [] and len(history) >= 3 and all(ok for _, ok, _ in history), history   # what SGLang's probe sees
    history, dead = asyncio.run(_watch("wedged", wired=True))
    assert len(dead) == 1, history
    assert dead[0].startswith("2 consecutive health probes failed (last: DP replica 1: no token within 0.3 s"), dead
    assert dead[0].endswith("; no progress during the probe)"), dead
    assert "replica 0" not in dead[0] and "engine:" not in dead[0], dead


@pytest.mark.timeout(60)
def test_busy_replica_is_not_dead():
    """Replica 1 answers no pinned probe in time but its own snapshot advances: busy, never declared dead."""
    history, dead = asyncio.run(_watch("busy", wired=True, run_s=1.5))
    assert dead == [] and len(history) >= 3, (history, dead)
    assert all(ok and d == "DP replica 1: busy (no token within 0.3 s (TimeoutError); scheduler iterated during "
               "the probe)" for _, ok, d in history), history


@pytest.mark.timeout(30)
def test_which_engines_are_probed_per_replica():
    """Plain replicas only: under DP attention the ranks step together (a stopped rank stalls the engine and
    fails `/health_generate`; tests/test_manager_engines.py), one rank is the engine."""
    attn_0523, attn_0515 = fact("dp-attn")["server_info"], {"dp_size": 2, "enable_dp_attention": True}
    assert plain_replicas(PLAIN) and not plain_replicas(attn_0523) and not plain_replicas(attn_0515)
    assert not plain_replicas({"dp_size": 1})
    table, engines = EngineTable(), [RemoteEngine(f"http://127.0.0.1:{p}") for p in (1, 2, 3)]
    for i, e in enumerate(engines):
        e.name = f"e{i}"
    table.admit(engines[0], 4, dp_ranks=2, replicas=True)
    table.admit(engines[1], 4, dp_ranks=2, replicas=False)
    table.admit(engines[2], 4, dp_ranks=1, replicas=True)
    assert [table.replicas(e) for e in engines] == [2, 1, 1]
    stale = RemoteEngine("http://127.0.0.1:1")
    stale.name = "e0"   # a restarted engine of the same name is not the admitted one
    assert table.replicas(stale) == 1


@pytest.mark.timeout(60)
def test_scheduler_cpu_of_one_replica():
    """Real processes named as SGLang names plain-DP schedulers (`scheduler_DP<r>`): one replica's state."""
    code = "import sys, time\nopen('/proc/self/comm', 'w').write(sys.argv[1])\nwhile True: time.sleep(0.05)\n"
    spawn = "import subprocess, sys; [subprocess.Popen([sys.executable, '-c', sys.argv[1], n]) " \
            "for n in ('scheduler_DP0', 'scheduler_DP1', 'scheduler_DP10')]; subprocess.run(['sleep', '60'])"
    parent = subprocess.Popen([sys.executable, "-c", spawn, code], start_new_session=True)
    eng = type("Local", (), {"backend": "local", "pid": parent.pid})()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            named = {p.name(): p for p in psutil.Process(parent.pid).children(recursive=True)}
            if {"scheduler_DP0", "scheduler_DP1", "scheduler_DP10"} <= set(named):
                break
            time.sleep(0.05)
        os.kill(named["scheduler_DP1"].pid, signal.SIGSTOP)
        time.sleep(0.3)
        got = {r: scheduler_cpu(eng, r)[1] for r in (0, 1, 10, 2)}
        found = {r: scheduler_cpu(eng, r)[0] is not None for r in (0, 1, 10, 2)}
        whole = scheduler_cpu(eng)[1]
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    assert got == {0: False, 1: True, 10: False, 2: False} and whole, got   # DP1 is not DP10
    assert found == {0: True, 1: True, 10: True, 2: False}, found


def _wedge(engine, rank: int) -> list:
    """From now on `engine` (a stand-in) never answers a request pinned to `rank`, as a stopped replica;
    returns the pinned bodies it swallowed."""
    inner, swallowed = engine.routes["/generate"], []

    async def generate(request):
        body = await request.json()
        if body.get("routed_dp_rank") == rank:
            swallowed.append(body)
            await asyncio.sleep(3600)
        return await inner(request)

    engine.routes["/generate"] = generate
    return swallowed


@pytest.mark.timeout(60)
def test_wedged_replica_takes_its_engine_out_its_groups_finish_elsewhere_once():
    """Two plain dp-2 stand-in engines, replica 1 of s-0 wedged after admission: the fleet's monitor
    declares s-0 dead naming the replica (one event line), its groups are placed again on s-1, each sample
    moved once, and the rollout completes. Before per-replica probes the rollout hung on them."""
    async def go():
        async with make_manager(n_samples=2, max_new_tokens=6, backend=StandinBackend(server_info=PLAIN)) as mgr:
            assert mgr.dispatcher.slots["s-0"].replicas and mgr.dispatcher.slots["s-0"].dp_ranks == 2
            swallowed = _wedge(mgr.source.engines["s-0"], WEDGED)
            stream = GroupStream(maxsize=64)
            task = asyncio.create_task(mgr.rollout(prompts(8), stream, batch_size=8))
            done, _ = await asyncio.wait({task}, timeout=20)
            history = list(mgr.source.monitor.history)
            assert done, f"the rollout hung on the wedged replica; health history: {history[-4:]}"
            await stream.close()
            return mgr, task.result(), [g async for g in stream], swallowed

    mgr, res, groups, swallowed = asyncio.run(go())
    dead = [e for e in mgr.events if e.kind == EngineEvent.DEAD]
    assert [e.engine for e in dead] == ["s-0"], [str(e) for e in dead]
    assert "health probes failed (last: DP replica 1: no token within 2 s" in dead[0].detail, dead[0].detail
    assert "\n" not in dead[0].detail and "in-flight request(s) re-sent" in dead[0].detail
    assert res.delivered == 8 and len({g.group_id for g in groups}) == 8 and res.failed_samples == 0
    stuck = {b["rid"].split("#")[0] for b in swallowed if "rid" in b}   # samples sent to the wedged replica
    assert stuck, "no group was placed on the wedged replica"
    for g in groups:
        for s in g.samples:
            assert s.status in ("completed", "truncated") and len(s.response_ids) == 6, (s.status, s.error)
            if s.sample_id in stuck:
                assert s.engines == ["s-0", "s-1"] and s.attempts == 2, (s.sample_id, s.engines)   # moved once
        if any(s.sample_id in stuck for s in g.samples):
            assert len({(s.engine, s.dp_rank) for s in g.samples}) == 1, g.group_id   # moved together
