"""The rollout manager against REAL SGLang CPU engines (tiny GLM-4.5 MoE, routed experts on).

One engine is shared by the whole module (one real server at a time on this 2-core machine). The kill -9
tests (this engine restarted; two engines with a re-send to the healthy one) and the stopped-DP-rank test
(two DP-attention engines, one rank's scheduler stopped) are e2e and run last.
"""
import asyncio
import copy
import os
import signal
import time

import pytest

from rollout.engines.client import EngineClient
from rollout import config as rconfig
from rollout.cli.engine import model_for
from rollout.engines.base import EngineStartError
from rollout.engines.health import HealthMonitor, http_probe
from rollout.engines.local_backend import LocalBackend
from rollout.engines.readiness import ReadinessError, wait_ready
from rollout.manager import RolloutManager
from rollout.net import free_port
from rollout.types import EngineEvent, SampleStatus
from rollout.stream import GroupStream
from rollout.models.tiny import NUM_LAYERS, TOP_K, expected_experts
from support.engines import two_rank_dp

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")


def _config(engines=1, max_new_tokens=8, path=CONFIG):
    cfg = rconfig.load(path)
    cfg.rollout.engine_auth = "key"  # the demo config is keyless (slime's managed mode); these engines take a key
    cfg.engine_groups[0].engines = engines
    # 4 running at a time while the manager keeps 8 in flight: the rest wait in SGLang's queue
    cfg.engine_groups[0].max_running_requests = 4
    cfg.rollout.sampling.max_new_tokens = max_new_tokens
    cfg.rollout.health.interval_s = 1.0
    for k in ("http_s", "server_up_s"):  # a loaded 2-core machine starts engines slowly
        setattr(cfg.rollout.budgets, k, 400.0)
    return cfg


def _prompts(n, length=12):
    return [[(7 * i + j) % 290 + 5 for j in range(length)] for i in range(n)]


async def _collect(mgr, prompts, batch_size=None):
    stream = GroupStream(maxsize=64)
    res = await mgr.rollout(prompts, stream, batch_size=batch_size)
    await stream.close()
    return res, [g async for g in stream]


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def mgr(loop, tmp_path_factory):
    cfg = _config()
    model = model_for(cfg, ROOT)
    m = RolloutManager.from_config(cfg, LocalBackend(str(tmp_path_factory.mktemp("logs"))), model,
                                   ports=[free_port()])
    loop.run_until_complete(m.start())
    pids = {n: e.pid for n, e in m.source.engines.items()}
    yield m
    engines = list(m.source.engines.values())
    loop.run_until_complete(m.stop())
    for e in engines:
        assert e.leftover_pids() == []
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_rollout_streams_groups_with_logprobs_and_routed_experts(loop, mgr):
    res, groups = loop.run_until_complete(_collect(mgr, _prompts(4)))
    assert res.delivered == 4 and len({g.group_id for g in groups}) == 4
    cfg = mgr.source.specs["tiny-0"].group
    assert cfg.routed_experts
    for g in groups:
        assert len(g.samples) == 2
        for s in g.samples:
            assert s.status in ("completed", "truncated"), s.error
            assert len(s.logprobs) == len(s.response_ids) > 0
            # compact R3: one row per token but the last, 2 MoE layers (1 dense dropped), top-4
            assert s.routed_experts.shape == (len(s.tokens) - 1, 2, 4)
            assert s.engine == "tiny-0" and s.weight_versions == ["default"]


def test_readiness_phases_pass_on_a_running_engine(loop, mgr):
    eng = mgr.source.engines["tiny-0"]

    async def go():
        async with EngineClient() as s:
            return await wait_ready(eng, mgr.source.budgets, s)

    info = loop.run_until_complete(go())
    assert info.dp_size == 1 and info.weight_version == "default"
    assert "one-token probe on every DP rank" in info.phase_s


def test_wrong_api_key_is_one_line_naming_the_cause(loop, mgr):
    eng = copy.copy(mgr.source.engines["tiny-0"])
    eng.spec = copy.copy(eng.spec)
    eng.spec.api_key = "wrong-key"

    async def go():
        async with EngineClient() as s:
            return await wait_ready(eng, mgr.source.budgets, s)

    t0 = time.monotonic()
    with pytest.raises(ReadinessError) as ei:
        loop.run_until_complete(go())
    assert "phase 'HTTP up'" in str(ei.value) and "API key rejected by the server (HTTP 401" in str(ei.value)
    # refused at the first 401, not after waiting the phase's budget out (whatever the machine's speed)
    assert "\n" not in str(ei.value) and time.monotonic() - t0 < mgr.source.budgets.http_s / 2


def test_port_already_taken_is_named(mgr, tmp_path):
    spec = mgr.source.specs["tiny-0"]
    with pytest.raises(EngineStartError, match=f"port {spec.port} on 127.0.0.1 is already taken"):
        LocalBackend(str(tmp_path)).start(spec)


def test_one_failed_probe_is_tolerated_n_in_a_row_kill(loop, mgr):
    eng = mgr.source.engines["tiny-0"]
    plan = [False, True, False, False, False]  # injected failures around real /health_generate probes
    deaths = []

    async def go():
        async with EngineClient() as s:
            real = http_probe(s, 30)

            async def probe(e):
                if plan and not plan.pop(0):
                    raise RuntimeError("injected failure")
                await real(e)

            async def on_dead(e, reason):
                deaths.append(reason)

            m = HealthMonitor(probe, on_dead, interval_s=0.1, failures=3, alive_poll_s=0.05)
            m.watch(eng)
            m.start()
            for _ in range(300):
                if deaths:
                    break
                await asyncio.sleep(0.1)
            await m.stop()
            return m

    m = loop.run_until_complete(go())
    oks = [ok for _, ok, _ in m.history]
    assert oks[:2] == [False, True]  # one failure did not kill it; the real probe then passed
    assert oks[2:5] == [False, False, False] and len(deaths) == 1
    assert "3 consecutive health probes failed" in deaths[0]
    assert eng.alive()  # the separate monitor only reports; the manager's engine is untouched


def _rows_match_tokens(s) -> bool:
    """The compact routed experts are, row for row, the experts the tiny model routes each token to."""
    seq = s.tokens[:-1]
    if s.routed_experts is None or s.routed_experts.shape != (len(seq), NUM_LAYERS - 1, TOP_K):
        return False
    return all([sorted(r) for r in s.routed_experts[:, layer - 1, :].tolist()] == expected_experts(seq, layer)
               for layer in range(1, NUM_LAYERS))


def test_partial_rollout_queued_and_running_aborts_resume_with_rows_matching_tokens(loop, mgr):
    """8 samples in flight on an engine running 4: when the batch (1 group) is full, the running ones
    are aborted with their tokens and routed experts so far, the queued ones with neither (SGLang
    0.5.23, tests/facts/sglang-0.5.23-abort.json). Both kinds are resumed and end with one routed-expert
    row per token, each the experts the model routes that token to."""
    mgr.dispatcher.sampling["max_new_tokens"] = 48
    mgr.dispatcher.sampling["ignore_eos"] = True
    groups = [mgr.new_group(p) for p in _prompts(4)]
    for g in groups:
        for s in g.samples:  # group 0 finishes first; the others are stragglers when the batch (1) is full
            s.max_new_tokens = 4 if g is groups[0] else 48
    mgr.carry = groups
    try:
        res1, got1 = loop.run_until_complete(_collect(mgr, [], batch_size=1))
        carried = [(s.status, len(s.response_ids), s.error) for g in mgr.carry for s in g.samples]
        res2, got2 = loop.run_until_complete(_collect(mgr, [], batch_size=len(mgr.carry)))
    finally:
        mgr.dispatcher.sampling["max_new_tokens"] = 8
        mgr.dispatcher.sampling.pop("ignore_eos")
    assert res1.delivered == 1 and res1.carried == 3 and got1[0].group_id == groups[0].group_id
    assert all(st == SampleStatus.ABORTED and err is None for st, _, err in carried), carried
    assert any(0 < n < 48 for _, n, _ in carried), carried          # running when aborted
    assert res1.unrouted_aborts >= 1 and any(n == 0 for _, n, _ in carried), carried  # queued when aborted
    assert res2.delivered == 3 and res2.failed_samples == 0
    assert all(s.resumes == 1 for g in got2 for s in g.samples)
    for s in [s for g in got1 + got2 for s in g.samples]:
        assert s.status == SampleStatus.TRUNCATED and len(s.response_ids) == s.max_new_tokens
        assert _rows_match_tokens(s), s.sample_id


@pytest.mark.e2e  # kill -9 and a full engine restart (~3 min here); make test keeps the rollout/abort/readiness tests
def test_kill9_mid_rollout_exactly_once_then_engine_serves_again(loop, mgr):
    old = mgr.source.engines["tiny-0"]
    # Long enough that the kill lands mid-generation even on a quiet machine (8 x 256 tokens).
    mgr.dispatcher.sampling["max_new_tokens"] = 256

    async def go():
        stream = GroupStream(maxsize=64)
        task = asyncio.create_task(mgr.rollout(_prompts(4), stream, batch_size=4))
        while not any(s.outstanding for s in mgr.dispatcher.slots.values()):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert not task.done(), "the rollout finished before the kill: make it longer"
        t_kill = time.monotonic()
        os.kill(old.pid, signal.SIGKILL)
        while not mgr.count(EngineEvent.DEAD):
            await asyncio.sleep(0.05)
        print(f"death seen {time.monotonic() - t_kill:.2f} s after the kill", flush=True)
        res = await asyncio.wait_for(task, timeout=600)
        await stream.close()
        return res, [g async for g in stream]

    try:
        res, groups = loop.run_until_complete(go())
    finally:
        mgr.dispatcher.sampling["max_new_tokens"] = 8
    # seen through the process (its poll or a dropped request), not after 3 failed health probes
    dead = next(e for e in mgr.events if e.kind == EngineEvent.DEAD)
    assert dead.detail.startswith("process killed by signal SIGKILL"), dead.detail
    assert old.leftover_pids() == []  # the killed engine's scheduler/detokenizer are gone too
    assert res.delivered == 4 and len({g.group_id for g in groups}) == 4 and res.resent >= 1
    assert all(s.status in ("completed", "truncated") for g in groups for s in g.samples)
    new = mgr.source.engines["tiny-0"]
    assert new is not old and new.alive() and mgr.count(EngineEvent.READMITTED)
    assert any(len(s.engines) > 1 for g in groups for s in g.samples)  # re-sent after the kill
    res2, _ = loop.run_until_complete(_collect(mgr, _prompts(2)))
    assert res2.delivered == 2 and mgr.dispatcher.slots["tiny-0"].engine is new


@pytest.mark.e2e
def test_two_engines_kill9_resends_to_the_healthy_one(tmp_path):
    cfg = _config(engines=2, max_new_tokens=24)
    model = model_for(cfg, ROOT)

    async def go():
        m = RolloutManager.from_config(cfg, LocalBackend(str(tmp_path)), model, ports=[free_port(), free_port()])
        async with m:
            stream = GroupStream(maxsize=64)
            task = asyncio.create_task(m.rollout(_prompts(8), stream, batch_size=8))
            while not m.dispatcher.slots["tiny-1"].outstanding:   # the kill lands on requests in flight
                await asyncio.sleep(0.05)
            victim = m.source.engines["tiny-1"]
            os.kill(victim.pid, signal.SIGKILL)
            res = await asyncio.wait_for(task, timeout=600)
            await stream.close()
            groups = [g async for g in stream]
            while not m.count(EngineEvent.READMITTED):
                await asyncio.sleep(0.5)
            return res, groups, victim

    res, groups, victim = asyncio.run(go())
    assert res.delivered == 8 and len({g.group_id for g in groups}) == 8
    assert victim.leftover_pids() == []
    # group placement (the config's default): a group's first attempts on one engine; the killed
    # engine's samples were re-sent elsewhere exactly once, each group's together
    assert cfg.rollout.group_placement == "group"
    for g in groups:
        assert len({s.engines[0] for s in g.samples}) == 1, [s.engines for s in g.samples]
        moved = [s.engines for s in g.samples if len(s.engines) > 1]
        assert all(set(e[:-1]) == {victim.name} and e[-1] == "tiny-0" for e in moved), moved
    assert any(len(s.engines) > 1 for g in groups for s in g.samples)


def _dp_rank_scheduler(engine, rank: int):
    """The scheduler process of DP rank `rank` among `engine`'s processes (SGLang names them
    `sglang::scheduler_DP<rank>_TP<tp>...` under DP attention, `sglang::scheduler_DP<rank>` for a plain
    replica of tp 1)."""
    import re

    import psutil

    procs = psutil.Process(engine.pid).children(recursive=True)
    names = [p.name() for p in procs]
    hits = [p for p in procs if re.search(rf"scheduler_DP{rank}(_|$)", p.name())]
    assert len(hits) == 1, f"no single DP{rank} scheduler among {names}"
    return hits[0]


def stop_one_rank_mid_rollout(cfg, tmp_path, victim_name: str, stop_rank: int, dead_within_s: float,
                              check_admitted=None):
    """Two engines of `cfg` roll out 8 groups; once a sample runs on (`victim_name`, `stop_rank`) that rank's
    scheduler is stopped (SIGSTOP) until its engine is declared dead. (result, groups, DEAD events, seconds to
    dead, the (engine, rank) of each sample in flight on the victim at the stop, sample id -> the (engine,
    rank) of each of its attempts). `check_admitted(manager)` runs once the engines are admitted."""
    model = model_for(cfg, ROOT)
    keys: dict = {}

    async def go():
        m = RolloutManager.from_config(cfg, LocalBackend(str(tmp_path)), model, ports=[free_port(), free_port()])
        async with m:
            if check_admitted:
                check_admitted(m)
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
                assert time.monotonic() - t0 < 300 and not task.done(), "nothing placed on the victim rank"
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
                    assert time.monotonic() - t_stop < dead_within_s, \
                        f"the stopped rank's engine was not declared dead; its health probes since: {history[-6:]}"
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
    print(f"declared dead {dead_s:.1f} s after the stop: {dead[0]}; in flight on {victim_name} then, by rank: "
          f"{ {r: sum(k[1] == r for k in at_stop.values()) for r in (0, 1)} }")
    return res, groups, dead, dead_s, at_stop, keys


def assert_moved_once_together(groups, keys, victim_name: str, other_name: str) -> list:
    """Every group's samples: moved at most once, first attempts on one rank, moved together to the other
    engine. The first attempt of each group's first sample."""
    firsts = []
    for g in groups:
        runs = [keys[s.sample_id] for s in g.samples]
        assert all(1 <= len(r) <= 2 for r in runs), runs                      # moved at most once
        assert len({r[0] for r in runs}) == 1, runs                           # first attempts on one rank
        assert len({r[1] for r in runs if len(r) == 2}) <= 1, runs            # moved together
        assert all(r[1][0] == other_name and r[0][0] == victim_name for r in runs if len(r) == 2), runs
        firsts.append(runs[0][0])
    return firsts


@pytest.mark.e2e  # two DP-attention engines (dp 2 each) start on CPU: minutes here
@pytest.mark.timeout(1500)
def test_stopped_dp_rank_is_a_dead_engine_its_groups_move_together_once(tmp_path):
    """SIGSTOP of ONE DP rank's scheduler of a DP-attention engine mid-rollout. Its ranks run in lockstep
    (the MLP sync gathers over every rank each scheduler step), so the whole engine stalls; the health
    probe sees no progress and a stopped scheduler, the monitor declares the engine dead as any dead
    engine, and its groups are placed again, together, on the other engine: every group exactly once."""
    cfg = _config(engines=2, max_new_tokens=96, path=rconfig.preset_path("c"))
    two_rank_dp(cfg.engine_groups[0])
    cfg.rollout.health.interval_s, cfg.rollout.health.timeout_s, cfg.rollout.health.failures = 1.0, 5.0, 2
    cfg.engine_groups[0].env["SGLANG_HEALTH_CHECK_TIMEOUT"] = "5"   # SGLang's /health_generate window
    assert cfg.rollout.group_placement == "group"
    victim_name, other_name, stop_rank = "tiny-dpattn-1", "tiny-dpattn-0", 1
    res, groups, dead, _, at_stop, keys = stop_one_rank_mid_rollout(cfg, tmp_path, victim_name, stop_rank, 300)
    assert [e.engine for e in dead] == [victim_name], [str(e) for e in dead]
    assert "consecutive health probes failed" in dead[0].detail and "scheduler stopped" in dead[0].detail, \
        dead[0].detail
    assert res.delivered == 8 and len({g.group_id for g in groups}) == 8 and res.failed_samples == 0
    assert all(s.status in ("completed", "truncated") for g in groups for s in g.samples)
    # lockstep: nothing in flight on the engine when one rank stopped finished there, the other rank's included
    assert at_stop and all(s.engine == other_name for g in groups for s in g.samples if s.sample_id in at_stop)
    firsts = assert_moved_once_together(groups, keys, victim_name, other_name)
    pinned = [g for g, first in zip(groups, firsts) if first == (victim_name, stop_rank)]
    assert pinned and all(s.engine == other_name for g in pinned for s in g.samples)   # finished on the other
