"""Manager logic (routing, exactly-once, re-send, partial rollout, backpressure, recovery) against
STAND-IN engines: small aiohttp servers in threads that speak the part of SGLang's HTTP API the
manager uses (/model_info, /ready, /server_info, /health_generate, /generate with logprobs and
routed experts, /abort_request). They are fakes, named as such; the real-engine versions of these
scenarios are in tests/test_manager_engines.py. Where the manager depends on an answer's exact shape
(an abort of a queued request, `/server_info` under DP), the stand-in answers what real SGLang 0.5.23
was recorded answering (tests/facts/, written by tests/record_real_answers.py).
"""
import asyncio

import numpy as np
import pybase64
import pytest
from aiohttp import web
from support.fake_sglang import FakeSGLang, answer, queued_abort_answer

from rollout.config import EngineSpec
from rollout.engines.fleet import ManagedFleet, Restarts
from rollout.net import free_port
from rollout.manager import RolloutManager, RolloutOptions, group_record
from rollout.routed_experts import MoELayout
from rollout.types import EngineEvent, SampleStatus
from rollout.stream import GroupStream
from training_configs.schema import EngineGroup, HealthConfig, ModelConfig, ReadinessBudgets

pytestmark = pytest.mark.timeout(60)   # stand-ins answer in milliseconds: fail fast

MODEL = ModelConfig(path="standin", num_layers=3, num_experts=8, topk=2, first_k_dense_replace=1)


def experts_of(token: int, layer: int) -> list:
    """The stand-in's router: a fixed function of the token, so rows can be checked against tokens."""
    return [(3 * token + layer + k) % MODEL.num_experts for k in range(MODEL.topk)]


def routed_payload(tokens: list, start: int = 0) -> str:
    """Rows for positions start .. len(tokens)-2 (SGLang never forwards the last token)."""
    rows = tokens[start:len(tokens) - 1]
    arr = np.zeros((len(rows), MODEL.num_layers, MODEL.topk), dtype="<i4")
    for r, tok in enumerate(rows):
        for layer in range(MODEL.first_k_dense_replace, MODEL.num_layers):
            arr[r, layer] = experts_of(tok, layer)
    return pybase64.b64encode(arr.tobytes()).decode()


class StandinEngine(FakeSGLang):
    """The fake SGLang server on the spec's port, with a token rule, queueing, aborts and stragglers, and the
    Engine handle for it."""

    backend = "standin"

    def __init__(self, spec, token_s=0.002, fail_health=False, slow_from=None, max_running=None, server_info=None):
        super().__init__({"/generate": lambda r: self._generate(r),  # looked up per request: a test may wrap it
                          "/health_generate": self._health, "/abort_request": self._abort_req},
                         host=spec.host, port=spec.port, server_info=server_info)
        self.spec, self.token_s, self.fail_health = spec, token_s, fail_health
        self.slow_from = slow_from  # prompts whose first id is >= this decode 20x slower (stragglers)
        self.max_running = max_running  # like --max-running-requests: the rest wait in a queue
        self.queued_aborts = 0
        self.requests, self.aborts, self.inflight_max, self._inflight, self._running = [], 0, 0, 0, 0
        self._killed = False
        self.start()
        self.abort_all = asyncio.run_coroutine_threadsafe(_event(), self.loop).result(10)

    name = property(lambda self: self.spec.name)
    url = property(lambda self: self.spec.url)
    api_key = property(lambda self: self.spec.api_key)
    pid = 0
    log_path = "/dev/null"

    async def _health(self, request):
        return web.Response(status=503 if self.fail_health else 200)

    async def _abort_req(self, request):
        self.aborts += 1
        self.abort_all.set()
        await asyncio.sleep(0.05)
        self.abort_all.clear()
        return web.Response(status=200)

    async def _generate(self, request):
        body = await request.json()
        self.requests.append(body)
        self._inflight += 1
        self.inflight_max = max(self.inflight_max, self._inflight)
        try:
            ids = body["input_ids"]
            n = body["sampling_params"]["max_new_tokens"]
            out, finish = [], {"type": "length", "length": n}
            if body.get("sampling_params", {}).get("max_new_tokens") == 1 and len(ids) == 1:
                return web.json_response(answer([3], finish, dp_rank=body.get("routed_dp_rank")))
            while self.max_running is not None and self._running >= self.max_running:
                if self.abort_all.is_set():
                    self.queued_aborts += 1
                    return web.json_response(queued_abort_answer())
                await asyncio.sleep(0.001)
            self._running += 1
            for i in range(n):
                if self._killed:  # like kill -9: the connection just drops
                    request.transport.close()
                    raise ConnectionResetError("killed")
                if self.abort_all.is_set():
                    finish = {"type": "abort", "message": "Aborted", "err_type": None, "status_code": None}
                    break
                slow = self.slow_from is not None and ids[0] >= self.slow_from
                await asyncio.sleep(self.token_s * (20 if slow else 1))
                out.append((sum(ids) + i) % 97 + 3)
            self._running -= 1
            routed = routed_payload(ids + out, body.get("routed_experts_start_len", 0)) \
                if body.get("return_routed_experts") else None
            return web.json_response(answer(out, finish, prompt_tokens=len(ids), routed_experts=routed))
        finally:
            self._inflight -= 1

    # Engine interface
    def alive(self):
        return not self._killed

    def exit_reason(self):
        return "process killed by signal SIGKILL" if self._killed else "process is running"

    def log_tail(self, n=20):
        return []

    def kill(self, sig=9):
        """Like kill -9: the server vanishes, open connections are dropped."""
        if not self._killed:
            self._killed = True
            self.drop()

    def stop(self):
        self.kill()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def leftover_pids(self):
        return []


async def _event():
    return asyncio.Event()


class StandinBackend:
    name = "standin"

    def __init__(self, **kw):
        self.kw, self.started = kw, []

    def start(self, spec):
        e = StandinEngine(spec, **self.kw)
        self.started.append(e)
        return e

    def shutdown(self):
        pass


def _ports(n):
    return [free_port() for _ in range(n)]


def make_manager(n_engines=2, n_samples=2, concurrency=4, max_new_tokens=8, partial=True, backend=None,
                 max_restarts=3, group_placement="group", **fleet):
    g = EngineGroup(name="s", engines=n_engines, gpus_per_engine=1, tp=1, routed_experts=True)
    specs = [EngineSpec(f"s-{i}", g, i, "127.0.0.1", p, "key", "x") for i, p in enumerate(_ports(n_engines))]
    source = ManagedFleet(
        specs, backend or StandinBackend(),
        ReadinessBudgets(process_s=2, http_s=5, server_up_s=5, health_generate_s=5, dp_probe_s=5),
        HealthConfig(interval_s=0.2, timeout_s=2, failures=2),
        restarts=Restarts(max_restarts=max_restarts, backoff_s=0.05), **fleet)
    return RolloutManager(source, RolloutOptions(
        {"temperature": 1.0, "max_new_tokens": max_new_tokens}, n_samples, concurrency,
        layout=MoELayout.from_model(MODEL), partial_rollout=partial, group_placement=group_placement))


def prompts(n):
    return [[5 + i, 6, 7, 8] for i in range(n)]


def test_groups_stream_exactly_once_with_routed_experts():
    async def go():
        async with make_manager() as mgr:
            stream = GroupStream(maxsize=4)
            got = []

            async def consume():
                async for g in stream:
                    got.append(g)

            c = asyncio.create_task(consume())
            res = await mgr.rollout(prompts(10), stream, batch_size=10)
            await stream.close()
            await c
            return mgr, res, got

    mgr, res, got = asyncio.run(go())
    assert res.delivered == 10 and len({g.group_id for g in got}) == 10
    for g in got:
        assert len(g.samples) == 2 and len({s.sample_id for s in g.samples}) == 2
        for s in g.samples:
            assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 8 and len(s.logprobs) == 8
            assert s.routed_experts.shape == (len(s.tokens) - 1, 2, 2)  # compact: 2 MoE layers, top-2
        rec = group_record(g)
        assert rec["samples"][0]["routed_experts"]["shape"] == [11, 2, 2]
    engines = {s.engine for g in got for s in g.samples}
    assert engines == {"s-0", "s-1"}  # least-outstanding routing uses both


def test_concurrency_bound_and_least_outstanding():
    async def go():
        backend = StandinBackend()
        async with make_manager(concurrency=3, max_new_tokens=20, backend=backend, group_placement="sample") as mgr:
            stream = GroupStream(maxsize=100)
            await mgr.rollout(prompts(12), stream, batch_size=12)
            return backend

    backend = asyncio.run(go())
    for e in backend.started:
        assert e.inflight_max <= 3
    n = [len([r for r in e.requests if len(r["input_ids"]) > 1]) for e in backend.started]
    assert abs(n[0] - n[1]) <= 2 and sum(n) == 24


def test_engine_death_resends_and_every_group_arrives_once():
    async def go():
        backend = StandinBackend()
        async with make_manager(max_new_tokens=30, backend=backend) as mgr:
            stream = GroupStream(maxsize=100)
            task = asyncio.create_task(mgr.rollout(prompts(12), stream, batch_size=12))
            await asyncio.sleep(0.15)
            backend.started[0].kill()
            res = await task
            await stream.close()
            got = [g async for g in stream]
            # the dead engine is restarted, re-admitted after readiness and serves again
            for _ in range(100):
                if mgr.count(EngineEvent.READMITTED):
                    break
                await asyncio.sleep(0.05)
            res2 = await mgr.rollout(prompts(6), GroupStream(100), batch_size=6)
            return mgr, res, got, backend, res2

    mgr, res, got, backend, res2 = asyncio.run(go())
    assert res.delivered == 12 and res.resent >= 1
    assert sorted(g.group_id for g in got) == sorted({g.group_id for g in got})
    assert all(s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 30 for g in got for s in g.samples)
    assert any(len(s.engines) > 1 for g in got for s in g.samples)  # re-sent samples
    assert len(backend.started) == 3 and mgr.count(EngineEvent.READMITTED) == 1
    assert res2.delivered == 6 and len(backend.started[2].requests) > 0  # the restarted engine serves


def test_health_failures_remove_and_restart_an_engine():
    async def go():
        backend = StandinBackend()
        async with make_manager(backend=backend) as mgr:
            mgr.source.engines["s-0"].fail_health = True  # after admission: start-up is never probed
            for _ in range(100):
                if mgr.count(EngineEvent.DEAD):
                    break
                await asyncio.sleep(0.05)
            return mgr

    mgr = asyncio.run(go())
    dead = [e.detail for e in mgr.events if e.kind == EngineEvent.DEAD and e.engine == "s-0"]
    assert dead and "2 consecutive health probes failed (last: HTTP 503; no progress during the probe)" in dead[0]


def test_partial_rollout_aborts_stragglers_and_continues_them_next_step():
    async def go():
        backend = StandinBackend(slow_from=7)  # groups 0 and 1 are fast, 2..5 are stragglers
        async with make_manager(concurrency=8, max_new_tokens=40, backend=backend) as mgr:
            stream = GroupStream(maxsize=100)
            # one fast batch of 2 groups out of 6 submitted: the other 4 are aborted mid-way
            res1 = await mgr.rollout(prompts(6), stream, batch_size=2)
            carried = [(s.status, len(s.response_ids)) for g in mgr.carried for s in g.samples]
            res2 = await mgr.rollout([], stream, batch_size=len(mgr.carried))
            await stream.close()
            got = [g async for g in stream]
            return res1, res2, carried, got

    res1, res2, carried, got = asyncio.run(go())
    assert res1.delivered == 2 and res1.carried == 4
    assert all(status is SampleStatus.ABORTED and 0 < n < 40 for status, n in carried)
    assert res2.delivered == 4 and len(got) == 6 and len({g.group_id for g in got}) == 6
    resumed = [s for g in got for s in g.samples if s.resumes]
    assert resumed
    for s in resumed:
        assert len(s.response_ids) == 40 and s.status is SampleStatus.TRUNCATED
        # routed experts merged across the abort: one row per token but the last
        assert s.routed_experts.shape[0] == len(s.tokens) - 1


def test_without_partial_rollout_stragglers_restart_under_their_ids():
    """The caller keys its own records by group id (the slime adapter does): a carried group keeps its id
    whether or not its tokens are kept; `drop_carried` forgets the carried groups."""
    async def go():
        backend = StandinBackend(slow_from=7)
        async with make_manager(concurrency=8, max_new_tokens=40, backend=backend, partial=False) as mgr:
            stream = GroupStream(maxsize=100)
            made = [mgr.new_group(p) for p in prompts(6)]
            await mgr.rollout(made, stream, batch_size=2)
            carried = mgr.carried
            dropped = mgr.drop_carried()
            return made, carried, dropped, mgr.carried

    made, carried, dropped, after = asyncio.run(go())
    assert len(carried) == 4 and {g.group_id for g in carried} <= {g.group_id for g in made}
    assert all(s.status is SampleStatus.PENDING and not s.response_ids for g in carried for s in g.samples)
    assert [g.group_id for g in dropped] == [g.group_id for g in carried] and after == []


def test_backpressure_no_drops_with_a_slow_consumer():
    async def go():
        async with make_manager(max_new_tokens=2) as mgr:
            stream = GroupStream(maxsize=1)
            got = []

            async def consume():
                async for g in stream:
                    await asyncio.sleep(0.03)
                    got.append(g.group_id)

            c = asyncio.create_task(consume())
            res = await mgr.rollout(prompts(15), stream, batch_size=15)
            await stream.close()
            await c
            return res, got, stream

    res, got, stream = asyncio.run(go())
    assert res.delivered == 15 and len(got) == 15 == len(set(got)) and stream.max_depth <= 1


def test_stream_refuses_a_second_delivery():
    from rollout.types import Group

    async def go():
        s = GroupStream(4)
        assert await s.put(Group("g1", [1], []))
        assert not await s.put(Group("g1", [1], []))
        return s

    assert asyncio.run(go()).duplicates == 1


def test_bad_routed_payload_fails_only_that_sample():
    async def go():
        mgr = make_manager()
        async with mgr:
            orig = mgr.client.generate

            async def corrupt(engine, body, timeout_s):
                out = await orig(engine, body, timeout_s)
                if body["rid"].startswith(f"{mgr.run_id}-g0/0#"):
                    out["meta_info"]["routed_experts"] = "AAAA"  # too short
                return out

            mgr.client.generate = corrupt
            stream = GroupStream(10)
            res = await mgr.rollout(prompts(3), stream, batch_size=3)
            await stream.close()
            return res, [g async for g in stream], mgr.run_id

    res, got, run_id = asyncio.run(go())
    assert res.delivered == 3 and res.failed_samples == 1 and list(res.failures.values()) == [1]
    bad = [s for g in got for s in g.samples if s.status == SampleStatus.FAILED]
    assert len(bad) == 1 and bad[0].sample_id == f"{run_id}-g0/0" and bad[0].error.startswith("routed experts:")
    assert "\n" not in bad[0].error


def test_weight_version_hook_gates_readmission():
    calls = []

    async def hook(engine, version):
        calls.append((engine.name, version))

    async def go():
        backend = StandinBackend()
        async with make_manager(backend=backend, weight_sync_hook=hook) as mgr:
            mgr.set_weight_version("v7")  # the stand-in keeps reporting "default"
            mgr.source.engines["s-0"].kill()
            for _ in range(100):
                if mgr.count(EngineEvent.GIVEN_UP):
                    break
                await asyncio.sleep(0.05)
            return mgr

    mgr = asyncio.run(go())
    assert calls and calls[0] == ("s-0", "v7")
    fails = [e.detail for e in mgr.events if e.kind == EngineEvent.RESTART_FAILED]
    assert fails and "weight version 'default' != expected 'v7'" in fails[0]
    assert "s-0" not in mgr.dispatcher.slots


def _rows_match_tokens(s) -> bool:
    """Every routed-expert row is the stand-in router's choice for the token at that position."""
    toks = s.tokens[:-1]
    if s.routed_experts is None or s.routed_experts.shape[0] != len(toks):
        return False
    return all(sorted(s.routed_experts[r, m].tolist()) == sorted(experts_of(t, m + MODEL.first_k_dense_replace))
               for r, t in enumerate(toks) for m in range(s.routed_experts.shape[1]))


def test_queued_abort_without_routed_experts_is_resumed_not_failed():
    """Concurrency 8 on an engine running 2 at a time: when the batch fills, the queued requests are
    aborted the way SGLang 0.5.23 does it (recorded: finish abort, no routed_experts, no tokens)."""
    async def go():
        backend = StandinBackend(slow_from=6, max_running=2)  # group 0 fast; the others straggle
        # per-sample routing: every request is sent at once, so some queue (a placed group's siblings wait
        # for their primer, which makes queueing depend on timing)
        async with make_manager(n_engines=1, concurrency=8, max_new_tokens=40, backend=backend,
                                group_placement="sample") as mgr:
            stream = GroupStream(maxsize=100)
            res1 = await mgr.rollout(prompts(4), stream, batch_size=1)
            carried = [(s.status, len(s.response_ids), s.error) for g in mgr.carried for s in g.samples]
            res2 = await mgr.rollout([], stream, batch_size=len(mgr.carried))
            await stream.close()
            return res1, res2, carried, [g async for g in stream], backend.started[0]

    res1, res2, carried, got, engine = asyncio.run(go())
    assert res1.delivered == 1 and res1.carried == 3
    # nothing failed; a carried group may hold a finished sample, or (group placement) one never sent
    assert all(st is not SampleStatus.FAILED and err is None for st, _, err in carried), carried
    assert any(st is SampleStatus.ABORTED for st, _, _ in carried)
    assert engine.queued_aborts >= 1 and res1.unrouted_aborts == engine.queued_aborts
    assert any(n == 0 for _, n, _ in carried)  # queued when aborted: no token, no routing, kept as it was
    assert res2.delivered == 3 and res2.failed_samples == 0 and len({g.group_id for g in got}) == 4
    for g in got:
        for s in g.samples:
            assert s.status == SampleStatus.TRUNCATED and len(s.response_ids) == 40
            assert _rows_match_tokens(s), s.sample_id


class _FailingRestarts(StandinBackend):
    """Starts `ok` engines, then every start raises an error of a type recovery did not list before."""

    def __init__(self, ok, **kw):
        super().__init__(**kw)
        self.ok, self.calls = ok, 0

    def start(self, spec):
        self.calls += 1
        if self.calls > self.ok:
            raise ValueError(f"cannot place {spec.name}: no free CPU")
        return super().start(spec)


def test_every_engine_given_up_fails_the_rollout_at_once_naming_engines_and_causes():
    import time

    from rollout.manager import EnginesLost

    async def go():
        backend = _FailingRestarts(ok=2)
        async with make_manager(max_new_tokens=400, backend=backend, max_restarts=2) as mgr:
            task = asyncio.create_task(mgr.rollout(prompts(6), GroupStream(100), batch_size=6))
            await asyncio.sleep(0.2)
            for e in backend.started:
                e.kill()
            t0 = time.monotonic()
            with pytest.raises(EnginesLost) as ei:
                await asyncio.wait_for(task, 20)   # without the verdict this waits forever
            return mgr, str(ei.value), time.monotonic() - t0

    mgr, msg, waited = asyncio.run(go())
    assert msg.startswith("every engine is lost: s-0: cannot place s-0: no free CPU; s-1: cannot place s-1")
    assert "\n" not in msg and waited < 10
    assert mgr.source.restart_failures == {"s-0": 2, "s-1": 2}   # every failed restart counted
    fails = [e.detail for e in mgr.events if e.kind == EngineEvent.RESTART_FAILED]
    assert fails.count("restart 1: cannot place s-0: no free CPU") == 1 and len(fails) == 4
    assert mgr.count(EngineEvent.ALL_LOST) == 1


def test_5xx_is_resent_with_a_growing_bounded_backoff():
    async def go():
        backend = StandinBackend()
        async with make_manager(n_engines=1, n_samples=1, backend=backend) as mgr:
            engine = backend.started[0]
            orig, times = engine._generate, []

            async def flaky(request):
                times.append(asyncio.get_running_loop().time())
                if len(times) <= 4:
                    return web.Response(status=503, text="Service Unavailable\n(overloaded)")
                return await orig(request)

            engine._generate = flaky
            mgr.dispatcher.backoff_s, mgr.dispatcher.backoff_max_s = 0.1, 0.3
            got = await mgr.rollout(prompts(1), GroupStream(10), batch_size=1)
            return got, times, mgr

    res, times, mgr = asyncio.run(go())
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert res.delivered == 1 and res.resent == 4 and len(times) == 5
    assert all(g >= want for g, want in zip(gaps, (0.1, 0.2, 0.3, 0.3))), gaps   # 0.1 * 2^k, capped at 0.3


def test_long_runs_keep_bounded_memory():
    """Dedupe ids, engine events and health history are windows, not ever-growing lists."""
    from rollout.types import Group, Sample
    from rollout.engines.health import HealthMonitor

    async def go():
        s = GroupStream(maxsize=1000, remember=4)
        groups = [Group(f"r-g{i}", [1], [Sample(f"r-g{i}/0", f"r-g{i}", 0, [1])]) for i in range(10)]
        for g in groups:
            assert await s.put(g)
        assert not await s.put(groups[-1])  # a duplicate inside the window is still refused
        return s

    s = asyncio.run(go())
    assert len(s.delivered) == 4 and len(s.samples) <= 32 and s.duplicates == 1
    mgr = make_manager(max_events=5)
    for i in range(12):
        mgr.source.events.log("s-0", EngineEvent.DEAD, str(i))
    assert len(mgr.events) == 5 and [e.detail for e in mgr.events_since(10)] == ["10", "11"]
    assert HealthMonitor(None, None, 1, 1, history=3).history.maxlen == 3



def test_a_groups_straggler_does_not_hold_back_the_next_groups():
    """Groups of 4 with one long sample each on one engine of 4 slots. The manager bounds the unfinished
    samples of started groups (twice the slots), not the groups: once the first two groups' short samples
    are answered, a third group starts beside their stragglers. The stand-in holds each straggler until a
    third group's request arrives (10 s at most). With a bound of two groups the third started only after
    a straggler's answer, while the slots beside the stragglers idled."""
    import time

    async def go():
        backend = StandinBackend()
        async with make_manager(n_engines=1, n_samples=4, concurrency=4, backend=backend) as mgr:
            eng, events = backend.started[0], []
            plain = eng._generate

            async def held(request):
                body = await request.json()   # aiohttp keeps the body: the stand-in reads it again
                events.append(("request", body["input_ids"][0]))
                if body["sampling_params"]["max_new_tokens"] == 30:   # a straggler
                    end = time.monotonic() + 10
                    while ("request", 7) not in events and time.monotonic() < end:
                        await asyncio.sleep(0.01)
                    events.append(("straggler answered", body["input_ids"][0]))
                return await plain(request)
            eng._generate = held
            groups = [mgr.new_group(p) for p in prompts(4)]   # group i's prompt starts with 5 + i
            for g in groups:
                g.samples[0].max_new_tokens = 30
                for s in g.samples[1:]:
                    s.max_new_tokens = 2
            res = await mgr.rollout(groups, GroupStream(maxsize=100), batch_size=4)
            return res, events

    res, events = asyncio.run(go())
    assert res.delivered == 4
    first_answer = next(i for i, e in enumerate(events) if e[0] == "straggler answered")
    assert ("request", 7) in events[:first_answer], f"the third group started after a straggler's answer: {events}"


def test_every_group_batch_starts_longest_first_and_an_over_sampled_one_as_given():
    """With every group to be delivered the manager starts the groups longest first (placement levels the
    ranks best so); with over-sampling (fewer to deliver than started) in the order given: which groups
    finish first decides the batch, as in slime's rollout."""
    async def go(batch_size):
        backend = StandinBackend()
        async with make_manager(n_engines=1, n_samples=2, concurrency=2, max_new_tokens=2, backend=backend) as mgr:
            ps = [[5] * 3, [6] * 9, [7] * 5]
            await mgr.rollout(ps, GroupStream(maxsize=100), batch_size=batch_size)
            firsts = [r["input_ids"][0] for r in backend.started[0].requests if len(r["input_ids"]) > 1]
            return list(dict.fromkeys(firsts))   # prompts in the order they first reached the engine
    assert asyncio.run(go(3)) == [6, 7, 5]
    assert asyncio.run(go(1))[0] == 5
