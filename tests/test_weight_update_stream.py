"""A weight update mid-rollout, as the manager's own consumers see it (`run`'s rows, `serve`'s groups), against the
STAND-IN SGLang of tests/support/updating_sglang.py (its spans from SGLang's own code); the real engine:
tests/test_serve_weight_update_engine.py.

The manager's update (`RolloutManager.update_weights_from_disk`, used by `run --weight-update` and serve's
`POST /update_weights`) pauses in retract mode: every group in flight keeps its tokens (no abort, no re-send,
nothing started again), is delivered once, and each sample's `weight_version_spans` names the version of each
token. slime's own abort-mode pause, for contrast, ends every request and the manager continues each one.
`rollout.max_weight_version_lag` (versions.StaleGate) keeps groups older than the lag from both consumers.
"""
import asyncio
import json
import re
from types import SimpleNamespace

import aiohttp
import pytest
import yaml
from support import ROOT
from support.fake_sglang import FakeSGLang, answer
from support.updating_sglang import UpdatingSGLang

from rollout import manager
from rollout.cli import main
from rollout.manager import RolloutManager, RolloutOptions, engine_source, group_record
from rollout.stream import GroupStream, pump
from rollout.types import Endpoint, SampleStatus

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("sglang.srt.utils.weight_versions")   # the stand-in's spans are SGLang's own (0.5.19+)
NEW = 40   # tokens per sample


def _manager(engines, concurrency=4, run_id="r"):
    source = engine_source(endpoints=[Endpoint(f"e{i}", e.url, "") for i, e in enumerate(engines)])
    return RolloutManager(source, RolloutOptions({"max_new_tokens": NEW, "temperature": 1.0}, 2, concurrency,
                                                 run_id=run_id))


def _prompts(n):
    return [[10 + i, 11 + i, 12 + i] for i in range(n)]


def _check_spans(samples, old="default", new="1"):
    """Every sample's spans cover its response; returns the samples whose tokens both versions sampled."""
    both = []
    for s in samples:
        spans = s["weight_version_spans"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == s["response_len"], s
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:])), s
        assert {x["version"] for x in spans} <= {old, new}, s
        if [x["version"] for x in spans] == [old, new]:
            both.append(s)
    return both


def test_each_answer_s_spans_reach_the_group_record():
    """The spans SGLang writes for a request that lived across an update (0.5.19+) are kept per sample: before,
    `group_record` (what `run` writes and `serve` hands out) had only the sorted set of versions."""
    from sglang.srt.utils.weight_versions import (WeightVersionEvent, add_weight_versions_to_meta_info,
                                                  compute_weight_version_spans)

    async def gen(request):
        out = answer([5] * 5, {"type": "length", "length": 5}, weight_version="4")
        add_weight_versions_to_meta_info(out["meta_info"], compute_weight_version_spans(
            [WeightVersionEvent(old_version="3", num_output_tokens=2)], "4", 5), 5)
        return aiohttp.web.json_response(out)

    eng = FakeSGLang({"/generate": gen}).start()
    try:
        async def go():
            async with _manager([eng]) as mgr:
                stream = GroupStream(8)
                await mgr.rollout(_prompts(1), stream)
                await stream.close()
                return [g async for g in stream]
        (group,) = asyncio.run(go())
    finally:
        eng.stop()
    rows = group_record(group)["samples"]
    assert [r["weight_version_spans"] for r in rows] == [[{"version": "3", "start": 0, "end": 2},
                                                          {"version": "4", "start": 2, "end": 5}]] * 2
    assert [r["weight_versions"] for r in rows] == [["4"], ["4"]]


def _update_mid_rollout(pause_body=None):
    """Six groups on one stand-in engine (two in flight at a time); once the first is consumed and a request in
    flight is midway, the weights change: by the manager's update, or (`pause_body`) by slime's sequence."""
    eng = UpdatingSGLang(tick_s=0.005).start()

    async def go(ckpt):
        async with _manager([eng]) as mgr:
            stream, got = GroupStream(64), []

            async def consume(group):
                got.append(group)
                if len(got) == 1:
                    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(eng.midway(), eng.loop))
                    if pause_body is None:
                        assert await mgr.update_weights_from_disk(ckpt, "1") == ["e0"]
                    else:   # slime's sequence: pause, flush, update, continue (its own client's calls)
                        async with aiohttp.ClientSession() as http:
                            for path, body in (("/pause_generation", pause_body), ("/flush_cache", None),
                                               ("/update_weights_from_disk", {"model_path": ckpt,
                                                                              "weight_version": "1"}),
                                               ("/continue_generation", {})):
                                async with http.post(eng.url + path, json=body) as r:
                                    assert r.status == 200, await r.text()
            res = await pump(mgr.rollout(_prompts(6), stream), stream, consume)
            return res, got, mgr.weight_version
    return eng, go


def test_the_manager_s_update_keeps_every_group_in_flight(tmp_path):
    """0 aborted, 0 re-sent, 0 started again; every group once; a sample spans both versions (it was mid-way)."""
    eng, go = _update_mid_rollout()
    try:
        res, got, version = asyncio.run(go(str(tmp_path)))
    finally:
        eng.stop()
    assert sorted(g.group_id for g in got) == [f"r-g{i}" for i in range(6)]
    samples = [s for g in got for s in g.samples]
    assert {(s.status, len(s.response_ids), s.attempts, s.resumes) for s in samples} == {
        (SampleStatus.TRUNCATED, NEW, 1, 0)}
    assert res.resent == 0 and res.delivered == 6
    routes = [(p, b) for p, b in eng.calls]
    assert routes[0] == ("/pause_generation", {"mode": "retract"}), routes
    assert ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}) in routes
    assert _check_spans([r for g in got for r in group_record(g)["samples"]])
    assert version == "1"    # a restarted engine must now report it


def test_slime_s_abort_mode_pause_ends_every_request_the_manager_continues_them(tmp_path):
    """What the retract-mode pause saves: SGLang's default (empty-body) pause aborts the requests in flight; the
    manager continues each from its tokens (a resume, its prefix prefilled again), none started from scratch."""
    eng, go = _update_mid_rollout(pause_body={})
    try:
        res, got, _ = asyncio.run(go(str(tmp_path)))
    finally:
        eng.stop()
    samples = [s for g in got for s in g.samples]
    assert sorted(g.group_id for g in got) == [f"r-g{i}" for i in range(6)]
    assert {(s.status, len(s.response_ids)) for s in samples} == {(SampleStatus.TRUNCATED, NEW)}
    assert sum(s.resumes for s in samples) >= 1 and max(s.attempts for s in samples) == 2
    assert _check_spans([r for g in got for r in group_record(g)["samples"]])


# ---------------------------------------------------------------- serve's API (rollout/cli/serve_stream.py)

async def _api(eng, prompts, key=None, **rollout):
    from rollout.cli.serve_stream import Control
    from rollout.net import free_port

    mgr = await _manager([eng]).start()
    args = SimpleNamespace(control_port=free_port())
    said = []
    ctl = await Control.open(mgr, SimpleNamespace(rollout=SimpleNamespace(host="127.0.0.1", **rollout)), args, prompts,
                             {}, key, said.append)
    return mgr, ctl, f"http://127.0.0.1:{args.control_port}", said


def _serve_across_an_update(tmp_path, **rollout):
    """A consumer reads with its cursor while it asks for a weight update mid-rollout (once it read a group and a
    request in flight is midway); an answer it loses once is asked for again with the same `after`."""
    eng = UpdatingSGLang(tick_s=0.005).start()

    async def go():
        mgr, ctl, url, said = await _api(eng, _prompts(6), **rollout)
        seen, after, updated, again = [], 0, None, None
        try:
            async with aiohttp.ClientSession() as http:
                while True:
                    async with http.get(f"{url}/groups", params={"after": after, "max": 2, "wait_s": 5}) as r:
                        body = await r.json()
                    if body["done"]:
                        break
                    if again is None and body["groups"]:   # lose this answer once: ask again with the same cursor
                        again = body
                        async with http.get(f"{url}/groups", params={"after": after, "max": 2, "wait_s": 5}) as r:
                            body = await r.json()   # the same groups first (more may have finished meanwhile)
                        assert body["groups"][:len(again["groups"])] == again["groups"]
                    seen += body["groups"]
                    after = body["next"]
                    if updated is None:
                        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(eng.midway(), eng.loop))
                        async with http.post(f"{url}/update_weights",
                                             json={"model_path": str(tmp_path), "weight_version": "1"}) as r:
                            assert r.status == 200, await r.text()
                            updated = await r.json()
            return seen, updated, body, said
        finally:
            await ctl.close()
            await mgr.stop()
    try:
        return asyncio.run(go())
    finally:
        eng.stop()


def test_serve_hands_out_every_group_once_across_an_update(tmp_path):
    """Every group once (the lost answer came back the same), none aborted, spans of both versions."""
    seen, updated, last, said = _serve_across_an_update(tmp_path)
    assert [g["seq"] for g in seen] == list(range(1, 7))
    assert sorted(g["group_id"] for g in seen) == [f"r-g{i}" for i in range(6)]
    samples = [s for g in seen for s in g["samples"]]
    assert {(s["status"], s["response_len"], s["attempts"], s["resumes"]) for s in samples} == {("truncated", NEW, 1, 0)}
    assert _check_spans(samples)
    assert updated["weight_version"] == "1" and updated["engines"] == ["e0"]
    assert last == {"groups": [], "next": 6, "done": True, "error": None, "weight_version": "1"}
    assert "rollout done: 6 group(s) delivered, 0 request(s) re-sent, 0 sample(s) failed" in said


def test_serve_staleness_bound_drops_groups_older_than_the_lag(tmp_path):
    """rollout.max_weight_version_lag 0 with stale_groups drop: a group with tokens of the old version that
    finishes after the update is never handed out, and is counted; the others are handed out once."""
    seen, _, last, said = _serve_across_an_update(tmp_path, max_weight_version_lag=0, stale_groups="drop")
    versions = [{x["version"] for s in g["samples"] for x in s["weight_version_spans"]} for g in seen]
    assert all(len(v) == 1 for v in versions), versions
    dropped = 6 - len(seen)
    assert dropped >= 1 and [g["seq"] for g in seen] == list(range(1, len(seen) + 1))
    assert last["done"] and any(f"stale groups: 0 regenerated, {dropped} dropped" in line for line in said), said


def test_serve_api_bad_input_is_one_line_and_the_key_is_required(tmp_path):
    eng = UpdatingSGLang().start()

    async def go():
        out = {}
        mgr, ctl, url, _ = await _api(eng, None, key="k1")
        try:
            async with aiohttp.ClientSession() as http:
                async def post(body, headers={"Authorization": "Bearer k1"}):
                    async with http.post(f"{url}/update_weights", data=body, headers=headers) as r:
                        return r.status, await r.text()
                out["no key"] = await post("{}", headers={})
                out["not json"] = await post("nope")
                out["no version"] = await post(json.dumps({"model_path": str(tmp_path)}))
                out["no dir"] = await post(json.dumps({"model_path": str(tmp_path / "x"), "weight_version": 2}))
                async with http.get(f"{url}/groups", headers={"Authorization": "Bearer k1"}) as r:
                    out["no rollout"] = r.status, await r.text()
        finally:
            await ctl.close()
            await mgr.stop()
        return out
    try:
        out = asyncio.run(go())
    finally:
        eng.stop()
    assert out["no key"] == (401, "missing or wrong API key (Authorization: Bearer KEY)\n")
    assert out["not json"] == out["no version"] == (400, 'body: give {"model_path": DIR, "weight_version": V}\n')
    assert out["no dir"] == (400, f"model_path: {str(tmp_path / 'x')!r} is not a directory\n")
    assert out["no rollout"] == (404, "serve rolls out nothing: start it with --num-groups or --prompts\n")
    assert eng.calls == []   # nothing reached the engine


def test_serve_flags(tmp_path, capsys):
    import socket

    cfg = str(ROOT / "training_configs" / "tiny-cpu.yaml")
    assert main(["serve", "--config", cfg, "--num-groups", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --num-groups / --prompts: give --control-port too (the consumer "
                                               "reads the groups there)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert main(["serve", "--config", cfg, "--control-port", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --control-port {taken}: cannot bind 127.0.0.1:{taken}") and len(err.splitlines()) == 1


def _six_groups_once(out) -> list:
    """The run's rows: 6 groups, each written once."""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and len({r["group_id"] for r in rows}) == 6, [r["group_id"] for r in rows]
    return rows


# ---------------------------------------------------------------- run --weight-update

def _run_config(tmp_path):
    d = yaml.safe_load((ROOT / "training_configs" / "tiny-cpu.yaml").read_text())
    d["engine_groups"][0]["routed_experts"] = False   # the stand-in sends no routed experts
    d["rollout"]["sampling"]["max_new_tokens"] = NEW
    d["rollout"]["concurrency_per_engine"] = 4
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def test_run_weight_update_mid_run_rows_carry_spans(tmp_path, monkeypatch, capsys):
    """`run --weight-update 2:CKPT`: after 2 lines the engines load CKPT as version 1 while the other groups run;
    every row once, none aborted or re-sent, spans of both versions in the rows; the summary names the update."""
    eng = UpdatingSGLang(tick_s=0.005).start()
    update = RolloutManager.update_weights_from_disk

    def from_config(cfg, backend, model_path, *, run_id=None, client=None, **fleet):
        return RolloutManager(engine_source(endpoints=[Endpoint("e0", eng.url, "")]),
                              RolloutOptions.from_config(cfg, run_id), client)

    async def midway_then_update(self, path, version):   # the update lands inside a request, whatever the speed
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(eng.midway(), eng.loop))
        return await update(self, path, version)

    monkeypatch.setattr(manager.RolloutManager, "from_config", staticmethod(from_config))
    monkeypatch.setattr(manager.RolloutManager, "update_weights_from_disk", midway_then_update)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = tmp_path / "rollouts.jsonl"
    try:
        rc = main(["run", "--config", _run_config(tmp_path), "--num-groups", "6", "--output", str(out),
                   "--weight-update", f"2:{ckpt}"])
    finally:
        eng.stop()
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    rows = _six_groups_once(out)
    samples = [s for r in rows for s in r["samples"]]
    assert {(s["attempts"], s["resumes"], s["response_len"]) for s in samples} == {(1, 0, NEW)}
    assert _check_spans(samples)
    assert all(s["weight_version_spans"] == [{"version": "default", "start": 0, "end": NEW}]
               for r in rows[:2] for s in r["samples"])
    assert "1 after 2 groups" in err
    assert eng.calls[0] == ("/pause_generation", {"mode": "retract"})


def test_run_staleness_bound_regenerates_groups_older_than_the_lag(tmp_path, monkeypatch, capsys):
    """rollout.max_weight_version_lag 0 (stale_groups regenerate): the groups that were in flight across the update
    are started again from their prompts under the new weights; every row once, each of one version."""
    eng = UpdatingSGLang(tick_s=0.005).start()
    update = RolloutManager.update_weights_from_disk

    def from_config(cfg, backend, model_path, *, run_id=None, client=None, **fleet):
        return RolloutManager(engine_source(endpoints=[Endpoint("e0", eng.url, "")]),
                              RolloutOptions.from_config(cfg, run_id), client)

    async def midway_then_update(self, path, version):
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(eng.midway(), eng.loop))
        return await update(self, path, version)

    monkeypatch.setattr(manager.RolloutManager, "from_config", staticmethod(from_config))
    monkeypatch.setattr(manager.RolloutManager, "update_weights_from_disk", midway_then_update)
    cfg = _run_config(tmp_path)
    d = yaml.safe_load(open(cfg))
    d["rollout"]["max_weight_version_lag"] = 0
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(d))
    ckpt, out = tmp_path / "ckpt", tmp_path / "rollouts.jsonl"
    ckpt.mkdir()
    try:
        rc = main(["run", "--config", cfg, "--num-groups", "6", "--output", str(out), "--weight-update", f"2:{ckpt}"])
    finally:
        eng.stop()
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    rows = _six_groups_once(out)
    versions = [{x["version"] for s in r["samples"] for x in s["weight_version_spans"]} for r in rows]
    assert all(len(v) == 1 for v in versions) and versions[-1] == {"1"}, versions
    assert re.search(r"stale groups\W+[1-9]\d* regenerated, 0 dropped", err), err[-2000:]


@pytest.mark.parametrize("flag, why", [
    ("2", "expected AFTER:CHECKPOINT (AFTER a positive group count), got '2'"),
    ("0:{ckpt}", "expected AFTER:CHECKPOINT (AFTER a positive group count), got '0:{ckpt}'"),
    ("2:{ckpt}/missing", "'{ckpt}/missing' is not a directory (a checkpoint the engines load from disk)"),
    ("6:{ckpt}", "--weight-update 6:...: after 6 group(s), but this run writes 6; the update would never happen"),
])
def test_run_weight_update_bad_flag_is_one_line_and_writes_nothing(tmp_path, capsys, flag, why):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = tmp_path / "rollouts.jsonl"
    rc = main(["run", "--config", _run_config(tmp_path), "--num-groups", "6", "--output", str(out),
               "--weight-update", flag.format(ckpt=ckpt)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and why.format(ckpt=ckpt) in err, err
    assert not out.exists()


def _standin_run(monkeypatch, eng):
    def from_config(cfg, backend, model_path, *, run_id=None, client=None, **fleet):
        return RolloutManager(engine_source(endpoints=[Endpoint("e0", eng.url, "")]),
                              RolloutOptions.from_config(cfg, run_id), client)

    monkeypatch.setattr(manager.RolloutManager, "from_config", staticmethod(from_config))


def test_resume_applies_the_recorded_update_before_any_group(tmp_path, monkeypatch, capsys):
    """A run with --weight-update 2:CKPT stopped after 3 lines: `--resume` (no flag) loads CKPT as version 1 before
    its first group, so every resumed row is of version 1, as the run would have been (was: base weights)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "rollouts.jsonl"
    ckpt.mkdir()
    cfg = _run_config(tmp_path)
    eng = UpdatingSGLang(tick_s=0.002).start()
    _standin_run(monkeypatch, eng)
    try:
        assert main(["run", "--config", cfg, "--num-groups", "6", "--output", str(out),
                     "--weight-update", f"2:{ckpt}"]) == 0
    finally:
        eng.stop()
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:3]))   # what a kill after 3 lines leaves
    capsys.readouterr()
    eng = UpdatingSGLang(tick_s=0.002).start()   # fresh engines: the base weights
    _standin_run(monkeypatch, eng)
    try:
        rc = main(["run", "--resume", str(out)])
    finally:
        eng.stop()
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    rows = _six_groups_once(out)
    assert all(s["weight_version_spans"] == [{"version": "1", "start": 0, "end": NEW}]
               for r in rows[3:] for s in r["samples"]), [r["samples"][0]["weight_version_spans"] for r in rows[3:]]
    assert "1 after 2 groups" in err
    assert eng.calls[0] == ("/pause_generation", {"mode": "retract"})


def test_resume_with_another_weight_update_is_one_line(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "rollouts.jsonl"
    ckpt.mkdir()
    from rollout.group_log import start

    start(str(out), {"run_id": "r1", "config": _run_config(tmp_path), "seed": 0, "num_groups": 6, "prompts": None,
                     "weight_updates": [[2, str(ckpt)]]}).close()
    rc = main(["run", "--resume", str(out), "--weight-update", f"3:{ckpt}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"error: --weight-update differs from the run being resumed (2:{ckpt}); drop it: the "
                               f"recorded updates apply"), err
    ckpt.rmdir()
    assert main(["run", "--resume", str(out)]) == 2
    assert capsys.readouterr().err.strip() == \
        f"error: --resume: the run's weight-update checkpoint {ckpt} is not a directory any more"
    (tmp_path / "rollouts.jsonl.run.json").write_text(json.dumps(
        {"run_id": "r1", "config": "c", "seed": 0, "num_groups": 6, "weight_updates": [["2", "x"]]}))
    assert main(["run", "--resume", str(out)]) == 2
    assert "is not a run description (weight_updates: expected a list of [after, checkpoint], got [['2', 'x']])" in \
        capsys.readouterr().err
