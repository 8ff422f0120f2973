"""A wedged plain `--dp-size` replica on REAL SGLang CPU engines (the stand-in versions:
tests/test_health_replicas.py). Slow: starts two engines of two replicas each.

Two engines of the tiny GLM-4.5 (routed experts on), each `--dp-size 2` without DP attention (two
replicas of tp 1: `extra_sglang_args.dp_size`, what a config can ask for). Mid-rollout ONE replica's
scheduler is stopped (SIGSTOP). Its engine's other replica keeps serving, so SGLang's `/health_generate`
keeps passing (any replica's output answers it): before per-replica probes the monitor's history showed
only passing probes and the groups on the stopped replica hung to the request timeout. With them the
pinned probe of that replica fails, its engine is declared dead in one event line naming the replica,
and its groups finish on the other engine, each sample moved at most once, the group together.
"""
import asyncio
import os
import time

import pytest
from test_manager_engines import CONFIG, ROOT, _config, _dp_rank_scheduler, _prompts

from rollout.cli.engine import model_for
from rollout.engines.local_backend import LocalBackend
from rollout.manager import RolloutManager
from rollout.net import free_port
from rollout.stream import GroupStream
from rollout.types import EngineEvent

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
WINDOW_S, TIMEOUT_S, INTERVAL_S, FAILURES = 5, 5.0, 1.0, 2
DEAD_WITHIN_S = 180   # failures x (interval + probe timeout) is 12 s; the rest is a loaded 2-core machine


@pytest.mark.timeout(1500)
def test_wedged_replica_is_taken_out_its_groups_finish_elsewhere_once(tmp_path):
    cfg = _config(engines=2, max_new_tokens=96, path=CONFIG)
    g = cfg.engine_groups[0]
    g.extra_sglang_args["dp_size"] = 2               # plain replicas: no enable_dp_attention
    g.env["SGLANG_HEALTH_CHECK_TIMEOUT"] = str(WINDOW_S)
    cfg.rollout.health.interval_s, cfg.rollout.health.timeout_s, cfg.rollout.health.failures = \
        INTERVAL_S, TIMEOUT_S, FAILURES
    assert cfg.rollout.group_placement == "group" and not g.enable_dp_attention
    model = model_for(cfg, ROOT)
    victim_name, other_name, stop_rank = "tiny-1", "tiny-0", 1
    keys: dict = {}   # sample id -> the (engine, DP rank) of each attempt, in order

    async def go():
        m = RolloutManager.from_config(cfg, LocalBackend(str(tmp_path)), model, ports=[free_port(), free_port()])
        async with m:
            assert {n: (s.dp_ranks, s.replicas) for n, s in m.dispatcher.slots.items()} == \
                {victim_name: (2, True), other_name: (2, True)}
            place = m.dispatcher.placement.place

            def recording(sample, cost, avoid=()):
                key = place(sample, cost, avoid)
                seen = keys.setdefault(sample.sample_id, [])
                if key is not None and (not seen or seen[-1] != key):
                    seen.append(key)
                return key

            m.dispatcher.placement.place = recording
            m.dispatcher.sampling["ignore_eos"] = True
            victim = m.source.engines[victim_name]
            stream = GroupStream(maxsize=64)
            task = asyncio.create_task(m.rollout(_prompts(8), stream, batch_size=8))
            t0 = time.monotonic()
            while not any(k == (victim_name, stop_rank) for k, _, _ in m.dispatcher.placement.current.values()):
                assert time.monotonic() - t0 < 300 and not task.done(), "nothing placed on the victim replica"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            assert not task.done(), "the rollout finished before the stop: make it longer"
            sched = _dp_rank_scheduler(victim, stop_rank)
            t_stop = time.monotonic()
            sched.suspend()
            at_stop = {sid: k for sid, (k, _, _) in m.dispatcher.placement.current.items() if k[0] == victim_name}
            try:
                while not m.count(EngineEvent.DEAD):
                    history = [h for h in m.source.monitor.history if h[0] == victim_name]
                    assert time.monotonic() - t_stop < DEAD_WITHIN_S, \
                        f"the wedged replica's engine was not declared dead; its health probes since: {history[-6:]}"
                    await asyncio.sleep(0.1)
                dead_s = time.monotonic() - t_stop
                res = await asyncio.wait_for(task, timeout=600)
            finally:
                try:
                    sched.resume()
                except Exception:   # the fleet's restart already killed it
                    pass
            await stream.close()
            dead = [e for e in m.events if e.kind == EngineEvent.DEAD]
            return res, [g async for g in stream], dead, dead_s, at_stop

    res, groups, dead, dead_s, at_stop = asyncio.run(go())
    on_stopped = {sid for sid, k in at_stop.items() if k[1] == stop_rank}
    print(f"declared dead {dead_s:.1f} s after the stop: {dead[0]}; in flight on {victim_name} then, by replica: "
          f"{ {r: sum(k[1] == r for k in at_stop.values()) for r in (0, 1)} }")
    assert [e.engine for e in dead] == [victim_name], [str(e) for e in dead]
    assert "consecutive health probes failed (last: DP replica 1: no token within" in dead[0].detail \
        and "scheduler stopped" in dead[0].detail and "DP replica 0" not in dead[0].detail, dead[0].detail
    assert res.delivered == 8 and len({g.group_id for g in groups}) == 8 and res.failed_samples == 0
    assert all(s.status in ("completed", "truncated") and len(s.response_ids) == 96 for g in groups for s in g.samples)
    assert on_stopped and all(s.engine == other_name for g in groups for s in g.samples if s.sample_id in on_stopped)
    for g in groups:
        runs = [keys[s.sample_id] for s in g.samples]
        assert all(1 <= len(r) <= 2 for r in runs), runs                      # moved at most once
        assert len({r[0] for r in runs}) == 1, runs                           # first attempts on one replica
        assert len({r[1] for r in runs if len(r) == 2}) <= 1, runs            # moved together
        assert all(r[1][0] == other_name and r[0][0] == victim_name for r in runs if len(r) == 2), runs
