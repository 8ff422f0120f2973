"""`slime-moe-rollout run`: bad input -> exit 2 and one line; the full demo (2 real engines) is e2e."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from rollout.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")


def _tiny():
    with open(TINY) as fh:
        return yaml.safe_load(fh)


def _write(tmp_path, data, name="bad.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def _run_bad(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_wrong_type(tmp_path, capsys):
    d = _tiny()
    d["engine_groups"][0]["tp"] = "two"
    err = _run_bad(capsys, ["run", "--config", _write(tmp_path, d)])
    assert "engine_groups[0].tp: expected an integer, got 'two'" in err


def test_tp_not_divisible_by_dp(tmp_path, capsys):
    d = _tiny()
    g = d["engine_groups"][0]
    g.update(tp=3, gpus_per_engine=3, dp=2, enable_dp_attention=True)
    d["cluster"]["gpus_per_node"] = 8
    err = _run_bad(capsys, ["run", "--config", _write(tmp_path, d)])
    assert "tp 3 is not divisible by dp 2" in err


def test_missing_model(tmp_path, capsys):
    d = _tiny()
    d["model"]["path"] = "/nonexistent/model"
    del d["model"]["build"]
    err = _run_bad(capsys, ["run", "--config", _write(tmp_path, d)])
    assert "model.path: '/nonexistent/model' does not exist" in err


def test_missing_field_and_invalid_yaml_and_missing_file(tmp_path, capsys):
    d = _tiny()
    del d["rollout"]["batch_size"]
    assert "rollout.batch_size: missing required field" in _run_bad(capsys, ["run", "--config", _write(tmp_path, d)])
    assert "invalid YAML" in _run_bad(capsys, ["run", "--config", _write(tmp_path, "a: [1, 2", "y.yaml")])
    assert "cannot read" in _run_bad(capsys, ["run", "--config", str(tmp_path / "none.yaml")])


def test_bad_arguments(tmp_path, capsys):
    assert "expected a positive integer" in _run_bad(capsys, ["run", "--config", TINY, "--num-groups", "0"])
    err = _run_bad(capsys, ["run", "--config", TINY, "--output", str(tmp_path / "no" / "x.jsonl")])
    assert "--output: directory" in err


def test_existing_output_resume_and_fraction_arguments(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    out.write_text('{"group_id": "x-g0"}\n')
    err = _run_bad(capsys, ["run", "--config", TINY, "--output", str(out)])
    assert "already holds 1 line(s); continue it with --resume" in err and out.read_text() == '{"group_id": "x-g0"}\n'
    assert "r.jsonl.run.json not found" in _run_bad(capsys, ["run", "--resume", str(out)])
    assert "expected a number in [0, 1], got 2" in _run_bad(capsys, ["run", "--config", TINY, "--max-failed-fraction", "2"])
    assert "--config is required (or --resume OUTPUT)" in _run_bad(capsys, ["run"])
    (tmp_path / "r.jsonl.run.json").write_text(json.dumps({"run_id": "a", "config": TINY, "seed": 0, "num_groups": 4}))
    err = _run_bad(capsys, ["run", "--resume", str(out), "--num-groups", "5"])
    assert "--num-groups 5 differs from the run being resumed (4); drop it" in err


def _verdict(capsys, records, fraction, written=2, lost=None):
    from types import SimpleNamespace

    from rich.console import Console

    from rollout.cli.run import Tally

    args = SimpleNamespace(max_failed_fraction=fraction, output="o.jsonl")
    rc = Tally(**records).verdict(Console(stderr=True), None, None, lost, {"num_groups": 2, "run_id": "r"}, written,
                                  args, 0.0, 0.0)
    return rc, capsys.readouterr().err


def test_summary_counts_deaths_and_failed_restarts_of_the_fleet(capsys):
    """The summary reads a real manager over a managed fleet (its events and failed-restart count)."""
    from types import SimpleNamespace

    from rich.console import Console

    from rollout.cli.run import Tally
    from rollout.engines.fleet import ManagedFleet
    from rollout.manager import RolloutManager, RolloutOptions, RolloutResult
    from rollout.types import EngineEvent

    fleet = ManagedFleet([SimpleNamespace(name="tiny-0")], None, None, None)
    fleet.events.log("tiny-0", EngineEvent.DEAD, "process killed by signal SIGKILL")
    fleet.restart_failures["tiny-0"] += 2
    mgr = RolloutManager(fleet, RolloutOptions({}, 1, 1))
    args = SimpleNamespace(max_failed_fraction=0.0, output="o.jsonl")
    rc = Tally(samples=2).verdict(Console(stderr=True, width=200), mgr, RolloutResult(delivered=2, wall_s=1.0),
                                  None, {"num_groups": 2, "run_id": "r"}, 2, args, 0.0, 1.0)
    err = capsys.readouterr().err
    assert rc == 0 and "1 / 0 (2 failed restarts)" in err


def test_exit_1_when_more_than_the_failed_fraction_failed(capsys):
    recs = {"samples": 4, "failed": 1, "reasons": {"routed experts: 3 rows, expected 5": 1}}
    rc, err = _verdict(capsys, recs, 0.0)
    assert rc == 1 and ("error: 1 of 4 samples failed (25.0% > --max-failed-fraction 0); most common: "
                        "routed experts: 3 rows, expected 5 (x1)") in err
    assert _verdict(capsys, recs, 0.25)[0] == 0
    rc, err = _verdict(capsys, {"samples": 2, "failed": 0, "reasons": {}}, 0.0, written=1)
    assert rc == 1 and "error: 1 of 2 group(s) have no line in o.jsonl" in err and "--resume o.jsonl" in err
    rc, err = _verdict(capsys, {"samples": 0, "failed": 0, "reasons": {}}, 0.0, written=0,
                       lost=RuntimeError("every engine is lost: tiny-0: process killed by signal SIGKILL"))
    assert rc == 1 and "error: every engine is lost: tiny-0: process killed by signal SIGKILL" in err


@pytest.mark.e2e
def test_demo_two_engines(tmp_path):
    """Exactly what `make demo` runs, with the output in a temp dir."""
    out = tmp_path / "rollouts.jsonl"
    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    p = subprocess.run([cli, "run", "--config", TINY, "--num-groups", "4", "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == 4 and len({ln["group_id"] for ln in lines}) == 4
    engines = {s["engine"] for ln in lines for s in ln["samples"]}
    assert engines == {"tiny-0", "tiny-1"}
    for ln in lines:
        for s in ln["samples"]:
            assert s["routed_experts"]["shape"][1:] == [2, 4] and s["routed_experts"]["sha256"]
    assert "groups written" in p.stderr and "4 / 4" in p.stderr


@pytest.mark.slow
def test_engine_exit_during_startup_real_sglang(tmp_path):
    """A real SGLang launcher that exits during start-up (unknown server flag): the log tail, then one
    error line naming the engine, the phase, its budget and the exit; exit 1; nothing left running."""
    d = _tiny()
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["engine_groups"][0]["engines"] = 1
    d["engine_groups"][0]["extra_sglang_args"]["no_such_flag"] = 1
    d["rollout"]["base_port"] = 31980
    cfg = _write(tmp_path, d, "exit.yaml")
    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    p = subprocess.run([cli, "run", "--config", cfg, "--output", str(tmp_path / "r.jsonl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: engine tiny-0: phase 'HTTP up' failed (budget 120 s): process exited with code 2")
    assert "unrecognized arguments: --no-such-flag 1" in last
    assert "  | " in p.stderr  # the log tail is shown above the error line
    log = (tmp_path / "r.jsonl.logs" / "tiny-0.log").read_text()
    assert "no-such-flag" in log
    out = subprocess.run(["pgrep", "-f", "--", "--no-such-flag"], capture_output=True, text=True)
    assert out.stdout.strip() == ""


def _free_base_port():
    from rollout.net import free_port

    return free_port()


def _wait(cond, budget_s, what):
    import time

    end = time.monotonic() + budget_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {budget_s} s")
        time.sleep(0.5)


def _kill9_once(args, tmp_path, until, what):
    """`slime-moe-rollout ARGS` killed with SIGKILL once `until()` holds (its engines die with it)."""
    import signal

    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    with open(tmp_path / "run1.err", "w") as err:
        p = subprocess.Popen([cli, *args], cwd=ROOT, stderr=err, stdout=subprocess.DEVNULL)
        try:
            _wait(lambda: until() or p.poll() is not None, 900, what)
            assert p.poll() is None, (tmp_path / "run1.err").read_text()[-2000:]
            os.kill(p.pid, signal.SIGKILL)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.e2e
@pytest.mark.timeout(1800)   # two engine starts on a loaded 2-core machine
def test_kill9_of_run_then_resume_gives_every_group_exactly_once(tmp_path):
    """kill -9 of `run` mid-way (its engines die with it), then `run --resume OUTPUT`: the lines
    left plus the lines added are every requested group exactly once, under the run's one id."""
    d = _tiny()
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["engine_groups"][0]["engines"] = 1
    d["rollout"]["sampling"]["max_new_tokens"] = 48
    d["rollout"]["base_port"] = _free_base_port()
    cfg, out, n = _write(tmp_path, d, "kill.yaml"), tmp_path / "r.jsonl", 12
    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    lines = lambda: out.read_text().count("\n") if out.exists() else 0  # noqa: E731
    _kill9_once(["run", "--config", cfg, "--num-groups", str(n), "--output", str(out)], tmp_path,
                lambda: lines() >= 2, "2 groups written")
    before = lines()
    assert 2 <= before < n, f"{before} lines before the kill: make the run longer"
    run_id = json.loads((tmp_path / "r.jsonl.run.json").read_text())["run_id"]
    _wait(lambda: subprocess.run(["pgrep", "-f", "--", f"--port {d['rollout']['base_port']}"],
                                 capture_output=True).returncode != 0, 60, "the killed run's engine gone")
    p2 = subprocess.run([cli, "run", "--resume", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p2.returncode == 0, p2.stderr[-3000:]
    ids = [json.loads(ln)["group_id"] for ln in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"{run_id}-g{i}" for i in range(n))  # every group, exactly once
    assert f"{n} / {n} ({n - before} in this run)" in p2.stderr


@pytest.mark.e2e
@pytest.mark.timeout(1800)   # two engine starts on a loaded 2-core machine
def test_kill9_of_run_across_a_weight_update_then_resume(tmp_path, tiny_model):
    """A REAL SGLang 0.5.23 CPU engine (routed experts on): `run --weight-update 2:CKPT` loads another checkpoint
    of the tiny model as version 1 after 2 lines; kill -9 once a line after the update is written, then
    `run --resume OUTPUT` (no flag): every group exactly once, none aborted or re-sent, the first 2 lines all of
    the base weights, every line of the resumed run all of version 1 (the recorded update applied before its first
    group), routed experts in every sample. The stand-in version: tests/test_weight_update_stream.py."""
    from rollout.models.tiny import build_tiny_glm

    other = build_tiny_glm(path=str(tmp_path / "tiny-glm45-seed1"), seed=1)
    d = _tiny()
    d["model"]["path"] = tiny_model
    d["engine_groups"][0].update(engines=1, routed_experts=True)
    d["rollout"]["sampling"]["max_new_tokens"] = 32
    d["rollout"]["base_port"] = _free_base_port()
    d["rollout"].update(concurrency_per_engine=2, batch_size=2)   # one group at a time: the lines trickle
    d["rollout"]["budgets"].update(http_s=600, server_up_s=600, health_generate_s=600)   # a loaded machine
    cfg, out, n = _write(tmp_path, d, "wu.yaml"), tmp_path / "r.jsonl", 24
    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    rows = lambda: [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []  # noqa: E731
    spans = lambda r: {x["version"] for s in r["samples"] for x in s["weight_version_spans"]}    # noqa: E731
    _kill9_once(["run", "--config", cfg, "--num-groups", str(n), "--output", str(out), "--weight-update",
                 f"2:{other}"], tmp_path, lambda: any("1" in spans(r) for r in rows()), "a line of version 1 written")
    first = rows()
    assert 3 <= len(first) < n, f"{len(first)} lines before the kill: make the run longer"
    assert all(spans(r) == {"default"} for r in first[:2]), [spans(r) for r in first]
    _wait(lambda: subprocess.run(["pgrep", "-f", "--", f"--port {d['rollout']['base_port']}"],
                                 capture_output=True).returncode != 0, 60, "the killed run's engine gone")
    p2 = subprocess.run([cli, "run", "--resume", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p2.returncode == 0, p2.stderr[-3000:]
    run_id = json.loads((tmp_path / "r.jsonl.run.json").read_text())["run_id"]
    got = rows()
    assert got[:len(first)] == first
    assert sorted(r["group_id"] for r in got) == sorted(f"{run_id}-g{i}" for i in range(n))  # exactly once
    assert all(spans(r) == {"1"} for r in got[len(first):]), [spans(r) for r in got[len(first):]]
    samples = [s for r in got for s in r["samples"]]
    assert {(s["status"], s["attempts"], s["resumes"]) for s in samples} <= {("completed", 1, 0), ("truncated", 1, 0)}
    assert all(s["routed_experts"] is not None for s in samples)
    assert "1 after 2 groups" in p2.stderr, p2.stderr[-2000:]


def test_resume_of_a_finished_run_starts_nothing(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    (tmp_path / "r.jsonl.run.json").write_text(json.dumps({"run_id": "a", "config": TINY, "seed": 0, "num_groups": 2}))
    out.write_text('{"group_id": "a-g0"}\n{"group_id": "a-g1"}\n')
    assert main(["run", "--resume", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    assert "nothing to run: all 2 group(s) of run a have a line" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists() or not os.listdir(tmp_path / "logs")



@pytest.mark.timeout(120)
@pytest.mark.parametrize("meta, lines, text", [
    ({"run_id": "AAA", "num_groups": 3}, ["BBB-g0", "BBB-g1", "BBB-g2"], "line 1 is group BBB-g0, not of run AAA"),
    ({"run_id": "a", "num_groups": 3}, ["a-g0", "a-g1", "a-g1"], "line 3 repeats group a-g1"),
    ({"run_id": "a", "num_groups": "3"}, ["a-g0"], "is not a run description (num_groups: expected int, got '3')"),
])
def test_resume_of_a_foreign_or_broken_log_is_one_line(tmp_path, capsys, meta, lines, text):
    """Before, a foreign log counted as done ("nothing to run", exit 0) and a wrong type raised a TypeError."""
    out = tmp_path / "r.jsonl"
    (tmp_path / "r.jsonl.run.json").write_text(json.dumps({"config": TINY, "seed": 0, **meta}))
    body = "".join(json.dumps({"group_id": g}) + "\n" for g in lines)
    out.write_text(body)
    err = _run_bad(capsys, ["run", "--resume", str(out), "--log-dir", str(tmp_path / "logs")])
    assert text in err and out.read_text() == body


@pytest.mark.e2e
@pytest.mark.timeout(1800)   # two runs, two engine starts each, on a loaded 2-core machine
def test_prompts_file_on_the_demo_config_then_resume(tmp_path):
    """`run --prompts` with the shipped prompt file: each group's line carries its row's label and
    metadata; a run cut to its first lines continues with `--resume` to every row exactly once."""
    d = _tiny()
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["rollout"]["base_port"] = _free_base_port()
    d["rollout"]["budgets"] = {k: 600 for k in ("http_s", "server_up_s", "health_generate_s", "dp_probe_s")}
    cfg, out = _write(tmp_path, d, "demo.yaml"), tmp_path / "r.jsonl"
    data = os.path.join(ROOT, "training_configs", "demo-prompts.jsonl")
    rows = [json.loads(ln) for ln in open(data)]
    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    p = subprocess.run([cli, "run", "--config", cfg, "--prompts", data, "--label-key", "label", "--num-groups", "6",
                        "--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n")          # as if the run had been killed after two groups
    p2 = subprocess.run([cli, "run", "--resume", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p2.returncode == 0, p2.stderr[-3000:]
    got = [json.loads(ln) for ln in out.read_text().splitlines()]
    run_id = json.loads((tmp_path / "r.jsonl.run.json").read_text())["run_id"]
    assert sorted(g["group_id"] for g in got) == sorted(f"{run_id}-g{i}" for i in range(6))
    for g in got:
        i = int(g["group_id"].rsplit("-g", 1)[1])
        assert (g["label"], g["metadata"]) == (rows[i]["label"], rows[i]["metadata"])
        assert all(s["status"] in ("completed", "truncated") for s in g["samples"])
    assert "6 / 6 (4 in this run)" in p2.stderr
