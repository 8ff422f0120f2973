"""Process hygiene with STAND-IN servers (tests/test_readiness.py run as a script): engines die with the
manager that started them (kill -9 included), engines a dead manager left on our ports are found,
reported and cleared, a port held by anything else is named, and the key stays off every argv.
The same with real SGLang behind `serve` is tests/test_engine_multinode.py (e2e)."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from rollout.config import EngineSpec
from rollout.net import free_port
from rollout.engines.base import EngineStartError
from rollout.engines.local_backend import LocalBackend
from rollout.engines.process import OWNER_ENV, group_pids
from training_configs.schema import EngineGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "test_readiness.py")

# A manager: starts one stand-in engine from an executor thread that then exits (as asyncio.to_thread's
# workers do at loop end), prints its pid, and waits to be killed.
MANAGER = textwrap.dedent("""
    import sys, threading, time
    from rollout.config import EngineSpec
    from rollout.engines.local_backend import LocalBackend
    from training_configs.schema import EngineGroup
    port = int(sys.argv[1])
    spec = EngineSpec("s-0", EngineGroup(name="s", engines=1, gpus_per_engine=1, tp=1), 0, "127.0.0.1", port,
                      "key", "/nonexistent")
    out = {}
    def start():
        out["e"] = LocalBackend(sys.argv[2], command=lambda s: ([sys.executable, sys.argv[3], "ok", str(port)], {})).start(spec)
    t = threading.Thread(target=start); t.start(); t.join()   # the starting thread is gone now
    print(out["e"].pid, flush=True)
    time.sleep(600)
""")


def _spec(port):
    g = EngineGroup(name="s", engines=1, gpus_per_engine=1, tp=1)
    return EngineSpec("s-0", g, 0, "127.0.0.1", port, "k", "/nonexistent")


def _wait_listening(port, budget=20.0):
    """Until a connect succeeds: a bound port is not yet a listening one (HTTPServer binds, looks up its
    own name, and only then listens), and a stale engine is one that listens."""
    end = time.monotonic() + budget
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            assert time.monotonic() < end, f"stand-in never listened on {port}"
            time.sleep(0.1)


@pytest.mark.timeout(60)
def test_kill9_of_the_manager_kills_its_engine(tmp_path):
    port = free_port()
    mgr = subprocess.Popen([sys.executable, "-c", MANAGER, str(port), str(tmp_path), STANDIN],
                           stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        engine_pid = int(mgr.stdout.readline())
        _wait_listening(port)
        assert group_pids(engine_pid), "the engine died with the thread that started it, not with the manager"
        os.kill(mgr.pid, signal.SIGKILL)
        mgr.wait(10)
        end = time.monotonic() + 10
        while group_pids(engine_pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert group_pids(engine_pid) == [], "engine outlived the manager killed with -9"
    finally:
        mgr.kill()
        for pid in group_pids(engine_pid) if "engine_pid" in dir() else []:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_restart_clears_a_stale_engine_left_by_a_dead_manager(tmp_path, capsys):
    port = free_port()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a manager pid that no longer exists
    stale = subprocess.Popen([sys.executable, STANDIN, "ok", str(port)], start_new_session=True,
                             env=dict(os.environ, **{OWNER_ENV: f"{dead.pid}:{port}"}), stdout=subprocess.DEVNULL)
    try:
        _wait_listening(port)
        backend = LocalBackend(str(tmp_path), command=lambda s: ([sys.executable, STANDIN, "ok", str(port)], {}))
        eng = backend.start(_spec(port))
        try:
            assert stale.wait(10) is not None
            assert backend.notes == [f"killed stale engine pid {stale.pid} on port {port} "
                                     f"(left by manager pid {dead.pid}, which is gone)"]
            assert "killed stale engine" in capsys.readouterr().err
            _wait_listening(port)
            assert eng.alive()
        finally:
            eng.stop()
    finally:
        stale.kill()


@pytest.mark.timeout(60)
def test_port_held_by_a_live_process_is_named_not_killed(tmp_path):
    port = free_port()
    other = subprocess.Popen([sys.executable, STANDIN, "ok", str(port)], stdout=subprocess.DEVNULL)
    try:
        _wait_listening(port)
        with pytest.raises(EngineStartError, match=f"port {port} on 127.0.0.1 is already taken by pid {other.pid}"):
            LocalBackend(str(tmp_path)).start(_spec(port))
        assert other.poll() is None
    finally:
        other.kill()


@pytest.mark.timeout(60)
def test_key_is_in_a_0600_file_not_on_argv_and_masked_in_log_tails(tmp_path):
    from rollout.engines.local_backend import LocalEngine
    from rollout.engines.process import ServerProcess
    # SGLang logs its server_args, api_key included: the stand-in does the same
    code = "import sys, time; print('server_args=' + open(sys.argv[-1]).read().strip(), flush=True); time.sleep(30)"
    spec = EngineSpec("s-0", EngineGroup(name="s", engines=1, gpus_per_engine=1, tp=1), 0, "127.0.0.1", 1,
                      "top-secret", "/m")
    p = ServerProcess([sys.executable, "-c", code], {}, str(tmp_path / "e.log"), api_key="top-secret")
    try:
        with open(f"/proc/{p.pid}/cmdline", "rb") as fh:
            cmdline = fh.read().decode()
        assert "top-secret" not in cmdline and "--config" in cmdline
        assert os.stat(p.secret_path).st_mode & 0o777 == 0o600
        assert "top-secret" in open(p.secret_path).read()
        end = time.monotonic() + 20
        while "server_args" not in open(p.log_path).read():
            assert time.monotonic() < end
            time.sleep(0.1)
        assert os.stat(p.log_path).st_mode & 0o777 == 0o600
        assert LocalEngine(spec, [p]).log_tail() == ['server_args=api-key: "***"']
    finally:
        p.stop()
    assert not os.path.exists(p.secret_path)
