"""Phased readiness and the health monitor against STAND-IN server processes (no SGLang).

The scenarios here are about the process and its answers (exits during start-up, hangs in a phase,
rejects the key, port taken, dies mid-phase), so a cheap stand-in process plays the server: this
file run as a script (`python tests/test_readiness.py MODE PORT`) serves the fake SGLang server
(tests/support/fake_sglang.py) in that process, its answers bent by MODE. The same
checks against real SGLang engines are in tests/test_manager_engines.py.
"""
import asyncio
import json
import os
import socket
import sys
import time

if __name__ != "__main__":
    import pytest

    from rollout.engines.client import EngineClient
    from rollout.config import EngineSpec
    from rollout.engines.base import EngineStartError
    from rollout.engines.health import HealthMonitor
    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.readiness import PHASES, ReadinessError, dp_ranks, wait_ready
    from rollout.net import free_port
    from training_configs.schema import EngineGroup, ReadinessBudgets


# ----------------------------------------------------------------------------- the stand-in server
FACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "facts")
# /server_info of SGLang 0.5.15.post1 and 0.5.16 (no CPU engine of theirs runs here; read from their code):
# http_server.server_info returns dataclasses.asdict(server_args), and their ServerArgs keeps dp_size
# as given (never reset under DP attention) and has no attn_dp_size field.
SERVER_INFO_0515 = {"dp_size": 2, "enable_dp_attention": True, "tp_size": 2}


def _fact(name):
    with open(os.path.join(FACTS, f"sglang-0.5.23-{name}.json")) as fh:
        return json.load(fh)


def _serve(mode: str, port: int) -> None:
    """The fake SGLang server (tests/support/fake_sglang.py) on `port`, its answers bent by `mode`."""
    from aiohttp import web
    from support.fake_sglang import FakeSGLang, answer

    started = time.monotonic()
    print(f"stand-in server: mode {mode}", flush=True)
    if mode == "exit":
        time.sleep(0.5)
        print("stand-in: fatal: cannot load the model", flush=True)
        sys.exit(3)
    if mode == "silent":
        while True:
            time.sleep(1)

    async def model_info(request):
        if mode == "auth":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"weight_version": "default"})

    async def ready(request):
        if mode == "no-ready":   # SGLang 0.5.15.post1 / 0.5.16: no such route (FastAPI's 404)
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.Response(status=503 if mode == "hang" else 200)

    async def health_generate(request):
        starting = mode == "no-ready" and time.monotonic() < started + 1.0
        return web.Response(status=503 if starting else 200)   # their /health_generate while Starting

    async def generate(request):
        body = await request.json()
        rank = body.get("routed_dp_rank")
        print(f"generate dp_rank={rank}", flush=True)
        if mode == "auth-generate":   # a key checked only on /generate
            return web.json_response({"error": "Unauthorized"}, status=401)
        if mode == "busy-500":        # a server error whose text happens to hold " 401 "
            return web.json_response({"error": "scheduler busy: 401 requests queued"}, status=500)
        if rank is not None and rank >= 2:  # the recorded answer to an out-of-range rank
            return web.json_response(json.loads(_fact("dp-attn")["out_of_range"]["text"]), status=400)
        served = 0 if mode == "one-rank" else rank  # one-rank: routing ignored, rank 0 serves all
        return web.json_response(answer([3], {"type": "length", "length": 1}, dp_rank=served))

    # /server_info as recorded from real SGLang 0.5.23 (tests/facts/), or 0.5.15.post1's fields
    info = {"ok-0515": SERVER_INFO_0515, "ok-plain": _fact("dp-plain")["server_info"]}.get(
        mode, _fact("dp-attn")["server_info"])
    FakeSGLang({"/model_info": model_info, "/ready": ready, "/health_generate": health_generate,
                "/generate": generate}, port=port, server_info=info).start()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
    sys.exit(0)


# ----------------------------------------------------------------------------- helpers
pytestmark = pytest.mark.timeout(60)   # stand-in processes: every budget here is a few seconds


def _spec(port, key="k"):
    g = EngineGroup(name="standin", engines=1, gpus_per_engine=1, tp=1)
    return EngineSpec("standin-0", g, 0, "127.0.0.1", port, key, "/nonexistent")


def _backend(tmp_path, mode):
    return LocalBackend(str(tmp_path), command=lambda spec: ([sys.executable, __file__, mode, str(spec.port)], {}))


# HTTP up: a stand-in's Python start, as long as a loaded machine takes; the later phases: seconds
BUDGETS = ReadinessBudgets(process_s=2, http_s=60, server_up_s=2, health_generate_s=2, dp_probe_s=2)


def _listening(engine, budget_s=60.0):
    """Until the stand-in accepts connections: what follows is timed from its first answer, not its start."""
    import socket

    end = time.monotonic() + budget_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", engine.spec.port), timeout=1.0).close()
            return
        except OSError:
            assert time.monotonic() < end and engine.alive(), "the stand-in never listened"
            time.sleep(0.05)


async def _ready(engine, budgets=BUDGETS):
    async with EngineClient() as s:
        return await wait_ready(engine, budgets, s)


def _run(engine, budgets=BUDGETS):
    try:
        return asyncio.run(_ready(engine, budgets))
    finally:
        engine.stop()
        assert engine.leftover_pids() == []  # no orphan processes


# ----------------------------------------------------------------------------- tests
def test_dp_ranks_from_each_versions_server_info():
    """0.5.23 (recorded): DP attention reports dp_size 1 and attn_dp_size N; plain --dp-size reports
    dp_size N and attn_dp_size 1; one rank reports 1 and 1. 0.5.15.post1/0.5.16: dp_size N either way."""
    assert _fact("dp-attn")["server_info"]["dp_size"] == 1  # the trap: reading dp_size alone probes rank 0 only
    assert dp_ranks(_fact("dp-attn")["server_info"]) == 2
    assert dp_ranks(_fact("abort")["server_info"]) == 1
    assert dp_ranks(_fact("dp-plain")["server_info"]) == 2
    assert dp_ranks(SERVER_INFO_0515) == 2 and dp_ranks({"dp_size": 2, "enable_dp_attention": False}) == 2


@pytest.mark.parametrize("mode", ["ok", "ok-plain", "ok-0515"])  # 0.5.23 DP attention / plain DP, 0.5.15-16
def test_all_phases_pass_and_every_dp_rank_is_probed(tmp_path, mode):
    eng = _backend(tmp_path, mode).start(_spec(free_port()))
    info = _run(eng)
    assert info.dp_size == 2 and list(info.phase_s) == [p.label for p in PHASES]
    assert info.rank_answers == {0: 0, 1: 1}  # each probe came back from the rank it was pinned to
    log = open(eng.log_path).read()
    assert "generate dp_rank=0" in log and "generate dp_rank=1" in log


def test_a_probe_served_by_another_rank_fails_at_once(tmp_path):
    eng = _backend(tmp_path, "one-rank").start(_spec(free_port()))
    with pytest.raises(ReadinessError, match=r"phase 'one-token probe on every DP rank'.*"
                                             r"DP rank 1: the probe was served by DP rank 0"):
        _run(eng)


def test_exit_during_startup_names_phase_and_log(tmp_path):
    eng = _backend(tmp_path, "exit").start(_spec(free_port()))
    t0 = time.monotonic()
    with pytest.raises(ReadinessError) as ei:
        _run(eng)
    msg = str(ei.value)
    assert "\n" not in msg
    assert "phase 'HTTP up'" in msg and "budget 60 s" in msg and "exited with code 3" in msg
    assert "cannot load the model" in msg and any("cannot load" in ln for ln in ei.value.log_tail)
    assert time.monotonic() - t0 < 30   # the exit is seen, not the phase's budget waited out


@pytest.mark.parametrize("version", ["0.5.15.post1", "0.5.16"])
def test_versions_without_a_ready_route(version):
    """Fact of the real code: these versions' HTTP server has no /ready, and their /health_generate
    answers 503 while the server status is Starting."""
    from support.variant_runs import python_of   # skips, or fails where make test requires the environment

    env = python_of(version).parents[1]
    text = next(env.glob("lib/python3*/site-packages/sglang/srt/entrypoints/http_server.py")).read_text()
    assert '@app.get("/ready")' not in text and '@app.get("/health_generate")' in text
    assert "server_status == ServerStatus.Starting:\n        return Response(status_code=503)" in text


def test_engine_without_a_ready_route_is_admitted_after_health_generate(tmp_path):
    eng = _backend(tmp_path, "no-ready").start(_spec(free_port()))
    info = _run(eng)   # without the 404 rule: "phase 'server status Up' failed ... HTTP 404 on /ready"
    assert info.dp_size >= 1


def test_hang_in_a_phase_fails_within_its_budget(tmp_path):
    eng = _backend(tmp_path, "hang").start(_spec(free_port()))
    _listening(eng)
    t0 = time.monotonic()
    with pytest.raises(ReadinessError) as ei:
        _run(eng)
    took = time.monotonic() - t0
    assert "phase 'server status Up'" in str(ei.value) and "budget 2 s" in str(ei.value)
    assert "HTTP 503 on /ready" in str(ei.value)
    assert took < 30   # it ends at the budget named above: no hang


def test_wrong_api_key_is_named_at_once(tmp_path):
    eng = _backend(tmp_path, "auth").start(_spec(free_port()))
    _listening(eng)
    t0 = time.monotonic()
    with pytest.raises(ReadinessError) as ei:
        _run(eng)
    assert "API key rejected" in str(ei.value) and "phase 'HTTP up'" in str(ei.value)
    assert time.monotonic() - t0 < BUDGETS.http_s / 2   # at the first 401, not at the phase's budget


def test_key_rejected_on_the_probe_is_named_at_once(tmp_path):
    """A key checked only on /generate: the DP probe's 401 is the client's `ApiKeyRejected`, named at once."""
    eng = _backend(tmp_path, "auth-generate").start(_spec(free_port()))
    with pytest.raises(ReadinessError) as ei:
        _run(eng)
    assert "phase 'one-token probe on every DP rank'" in str(ei.value) and "not reached within" not in str(ei.value)
    assert "API key rejected by the server (HTTP 401" in str(ei.value)


def test_a_server_error_mentioning_401_is_not_a_rejected_key(tmp_path):
    """A rejected key is told by the answer's status, never by searching error text for " 401 ": a 500
    whose body holds " 401 " is waited out as the server error it is."""
    eng = _backend(tmp_path, "busy-500").start(_spec(free_port()))
    with pytest.raises(ReadinessError) as ei:
        _run(eng)
    assert "API key rejected" not in str(ei.value), str(ei.value)
    assert "not reached within 2 s (last: DP rank 0: HTTP 500" in str(ei.value)


def test_port_already_taken(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineStartError, match=f"port {port} on 127.0.0.1 is already taken"):
            _backend(tmp_path, "ok").start(_spec(port))


def test_death_mid_phase_is_seen_at_once(tmp_path):
    eng = _backend(tmp_path, "silent").start(_spec(free_port()))
    budgets = ReadinessBudgets(process_s=2, http_s=60, server_up_s=2, health_generate_s=2, dp_probe_s=2)

    async def go():
        task = asyncio.create_task(_ready(eng, budgets))
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        eng.kill()
        with pytest.raises(ReadinessError) as ei:
            await task
        return time.monotonic() - t_kill, ei.value

    try:
        took, err = asyncio.run(go())
    finally:
        eng.stop()
    assert "killed by signal SIGKILL" in str(err) and "phase 'HTTP up'" in str(err)
    assert took < budgets.http_s / 4   # seen at a poll (<= 0.2 s apart), not when the phase's 60 s run out


class _FakeEngine:
    def __init__(self, name):
        self.name, self.dead = name, False

    def alive(self):
        return not self.dead

    def exit_reason(self):
        return "process exited with code 9"


def test_health_one_failure_is_tolerated_n_in_a_row_kill():
    plan = {"a": [False, True, False, True, True], "b": [False, False, False]}
    deaths = []

    async def probe(engine):
        ok = plan[engine.name].pop(0) if plan[engine.name] else True
        if not ok:
            raise RuntimeError("HTTP 503")

    async def on_dead(engine, reason):
        deaths.append((engine.name, reason))

    async def go():
        m = HealthMonitor(probe, on_dead, interval_s=0.05, failures=3, alive_poll_s=0.01)
        a, b, c = _FakeEngine("a"), _FakeEngine("b"), _FakeEngine("c")
        m.watch(a)
        m.watch(b)
        m.start()
        await asyncio.sleep(0.6)
        assert [d[0] for d in deaths] == ["b"] and "3 consecutive health probes failed" in deaths[0][1]
        m.watch(c)
        c.dead = True  # process death: no need to wait for probes
        await asyncio.sleep(0.1)
        await m.stop()
        return m

    m = asyncio.run(go())
    assert [d[0] for d in deaths] == ["b", "c"] and deaths[1][1] == "process exited with code 9"
    assert [ok for n, ok, _ in m.history if n == "a"][:5] == [False, True, False, True, True]


def test_health_never_probes_an_engine_that_is_not_admitted():
    probed = []

    async def probe(engine):
        probed.append(engine.name)

    async def go():
        m = HealthMonitor(probe, lambda e, r: None, interval_s=0.02, failures=1, alive_poll_s=0.01)
        m.start()
        await asyncio.sleep(0.2)  # an engine in start-up is simply not watched yet
        await m.stop()

    asyncio.run(go())
    assert probed == []


@pytest.mark.parametrize("meta, field", [({"completion_tokens": "1"}, "meta_info.completion_tokens is '1'"),
                                         ({"completion_tokens": 1, "dp_rank": "one"}, "meta_info.dp_rank is 'one'"),
                                         (None, "meta_info is missing")])
def test_a_malformed_probe_answer_is_named_by_its_field(meta, field):
    """The DP probe reads its answer through rollout.engines.answer: a wrong shape is one line naming the
    engine and field (was a raw TypeError / ValueError)."""
    from rollout.engines.answer import BadAnswer
    from rollout.engines.readiness import probe_dp_rank

    class Client:   # stands in for EngineClient.generate: the malformed 200 body under test
        async def generate(self, engine, payload, timeout_s):
            return {"text": "", "meta_info": meta} if meta is not None else {"text": ""}

    engine = type("E", (), {"name": "e0"})()
    with pytest.raises(BadAnswer, match=f"malformed answer from e0: {field}"):
        asyncio.run(probe_dp_rank(Client(), engine, 0, 1.0))
