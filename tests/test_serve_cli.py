"""`slime-moe-rollout serve`: bad input -> exit 2 and one line (fast); one real engine served and stopped (e2e)."""
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from rollout.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")


def _tiny():
    with open(TINY) as fh:
        return yaml.safe_load(fh)


def _write(tmp_path, data, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def _bad(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_missing_config_file(tmp_path, capsys):
    err = _bad(capsys, ["serve", "--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in err


def test_invalid_field(tmp_path, capsys):
    d = _tiny()
    d["engine_groups"][0]["tp"] = "two"
    err = _bad(capsys, ["serve", "--config", _write(tmp_path, d)])
    assert "engine_groups[0].tp: expected an integer, got 'two'" in err


def test_missing_model(tmp_path, capsys):
    d = _tiny()
    d["model"]["path"] = "/nonexistent/model"
    del d["model"]["build"]
    err = _bad(capsys, ["serve", "--config", _write(tmp_path, d)])
    assert "model.path: '/nonexistent/model' does not exist" in err


def test_managed_with_keyed_engines_is_refused_before_any_start(tmp_path, capsys):
    d = _tiny()
    d["rollout"]["engine_auth"] = "key"
    err = _bad(capsys, ["serve", "--config", _write(tmp_path, d)])
    assert "rollout.engine_auth: slime.integration managed needs 'none'" in err and "answer 401" in err


def test_bad_args(tmp_path, capsys):
    _bad(capsys, ["serve"])                                            # --config is required
    _bad(capsys, ["serve", "--config", TINY, "--backend", "slurm"])
    err = _bad(capsys, ["serve", "--config", TINY, "--base-port", "80"])
    assert "--base-port" in err
    f = tmp_path / "file"
    f.write_text("")
    err = _bad(capsys, ["serve", "--config", TINY, "--log-dir", str(f)])
    assert "--log-dir" in err


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            st = fh.read()
    except OSError:
        return False
    return st[st.rfind(")") + 2] != "Z"


def _children(pid: int) -> set:
    """Every descendant of pid (by /proc parent links)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    st = fh.read()
            except OSError:
                continue
            parent[int(d)] = int(st[st.rfind(")") + 2:].split()[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


@pytest.mark.e2e   # 60-130 s on a busy 2-core machine (the engine start-up dominates): over the slow budget
def test_serve_one_engine_until_sigterm(tmp_path):
    """A real SGLang CPU engine: addresses printed when ready, /health_generate answers, SIGTERM stops all."""
    d = _tiny()
    d["engine_groups"][0]["engines"] = 1
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["rollout"]["base_port"] = 31700
    d["rollout"]["budgets"].update(http_s=400, server_up_s=300)   # a loaded machine starts slowly
    cfg = _write(tmp_path, d)
    expected = subprocess.run([sys.executable, "-m", "rollout.cli", "config", "render", cfg,
                               "--format", "external-addrs"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "serve", "--config", cfg,
                             "--log-dir", str(tmp_path / "logs")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "serve.err", "w"), text=True)
    engine_pids: set = set()
    try:
        line = proc.stdout.readline().strip()      # printed only once every engine is admitted
        assert line == expected == "127.0.0.1:31700", (line, (tmp_path / "serve.err").read_text()[-2000:])
        engine_pids = _children(proc.pid)
        assert engine_pids
        assert not (tmp_path / "logs" / "api_key").exists()   # tiny-cpu: engine_auth none (slime sends no key)
        req = urllib.request.Request(f"http://{line}/health_generate")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = (tmp_path / "serve.err").read_text()
        assert "ready: 1 engine(s) up" in err and "stopped" in err and "no API key, bound to 127.0.0.1" in err
        assert "--rollout-external-engine-addrs 127.0.0.1:31700" in err
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_pid_alive(p) for p in engine_pids):
            time.sleep(0.2)
        assert not [p for p in engine_pids if _pid_alive(p)]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for p in engine_pids:
            if _pid_alive(p):
                os.kill(p, signal.SIGKILL)


def _StandInManager(names):
    """A real RolloutManager that starts nothing (its events are what serve supervises); stop() is recorded."""
    from types import SimpleNamespace

    from rollout.engines.fleet import ManagedFleet
    from rollout.manager import RolloutManager, RolloutOptions

    fleet = ManagedFleet([SimpleNamespace(name=n) for n in names], None, None, None)
    mgr = RolloutManager(fleet, RolloutOptions({}, 1, 1))
    mgr.stopped = False

    async def stop():
        mgr.stopped = True

    mgr.stop = stop
    return mgr


def test_supervise_reports_events_and_stops_on_signal(capsys):
    from rollout.types import EngineEvent

    import asyncio

    from rich.console import Console

    from rollout.cli.serve import _supervise

    async def go():
        mgr, stop = _StandInManager(["tiny-0", "tiny-1"]), asyncio.Event()
        task = asyncio.create_task(_supervise(mgr, stop, Console(stderr=True)))
        await asyncio.sleep(0.1)   # start-up events (before supervising) are not repeated
        mgr.source.events.log("tiny-0", EngineEvent.DEAD,
                              "process killed by signal SIGKILL; 2 in-flight request(s) re-sent")
        mgr.source.events.log("tiny-0", EngineEvent.READMITTED, "restart 1 passed every readiness phase")
        await asyncio.sleep(0.7)
        stop.set()
        return await task, mgr

    rc, mgr = asyncio.run(go())
    err = capsys.readouterr().err
    assert rc == 0 and mgr.stopped
    assert "tiny-0: dead: process killed by signal SIGKILL" in err and "tiny-0: re-admitted: restart 1 passed" in err


def test_supervise_exits_1_when_every_engine_is_given_up(capsys):
    from rollout.types import EngineEvent

    import asyncio

    from rich.console import Console

    from rollout.cli.serve import _supervise

    async def go():
        mgr = _StandInManager(["tiny-0"])
        task = asyncio.create_task(_supervise(mgr, asyncio.Event(), Console(stderr=True)))
        await asyncio.sleep(0.1)
        mgr.source.events.log("tiny-0", EngineEvent.GIVEN_UP, "3 restart(s) failed (last: HTTP up not reached)")
        await asyncio.sleep(0.7)
        assert not task.done()  # giving up one engine is not the verdict: the manager's ALL_LOST is
        mgr.source.events.log("tiny-0", EngineEvent.ALL_LOST, "every engine is lost: tiny-0: HTTP up not reached")
        return await asyncio.wait_for(task, 5), mgr

    rc, mgr = asyncio.run(go())
    err = capsys.readouterr().err
    assert rc == 1 and mgr.stopped
    assert "tiny-0: given up: 3 restart(s) failed (last: HTTP up not reached)" in err
    assert "error: every engine is lost: tiny-0: HTTP up not reached" in err


def test_served_addrs_are_node0_urls_in_config_order():
    """With `--backend ray` an engine's node 0 may be another host: print where it serves, not rollout.host."""
    from types import SimpleNamespace as NS

    from rollout.cli.serve import served_addrs

    fleet = NS(specs={"e0": None, "e1": None},   # config order; engines came up in the other order
               engines={"e1": NS(url="http://10.0.0.7:30010"), "e0": NS(url="http://10.0.0.5:30000")})
    assert served_addrs(fleet) == "10.0.0.5:30000 10.0.0.7:30010"
