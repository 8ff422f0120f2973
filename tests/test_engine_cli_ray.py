"""`run --backend ray` and `serve --backend ray` end to end through the CLI with a real SGLang CPU engine,
and kill -9 of `serve` (local and Ray backends) leaves no engine process; the key is on no argv.
Engine processes are found by the owner mark the spawner puts in their environment (any parent)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rollout.net import free_port
from rollout.engines.process import OWNER_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")


def _config(tmp_path, port, key=None):
    with open(TINY) as fh:
        d = yaml.safe_load(fh)
    d["engine_groups"][0]["engines"] = 1
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["rollout"]["base_port"] = port
    d["rollout"]["api_key"] = key
    d["rollout"]["sampling"]["max_new_tokens"] = 8
    d["rollout"]["budgets"].update(http_s=400, server_up_s=300)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def _engine_procs(port) -> dict:
    """{pid: cmdline} of live processes carrying our owner mark for `port`."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{d}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(e.startswith(f"{OWNER_ENV}=".encode()) and e.endswith(f":{port}".encode()) for e in env):
            out[int(d)] = cmd
    return out


def _cli(*args):
    return [os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout"), *args]


@pytest.mark.timeout(900)
def test_run_backend_ray_streams_groups(tmp_path):
    port = free_port()
    out = tmp_path / "r.jsonl"
    t0 = time.monotonic()
    p = subprocess.run(_cli("run", "--backend", "ray", "--config", _config(tmp_path, port), "--num-groups", "2",
                            "--output", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=880)
    print(f"run --backend ray: {time.monotonic() - t0:.1f} s", flush=True)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == 2 and len({ln["group_id"] for ln in lines}) == 2
    assert all(s["engine"] == "tiny-0" and s["routed_experts"]["shape"][1:] == [2, 4]
               for ln in lines for s in ln["samples"])
    assert _engine_procs(port) == {}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_serve_kill9_leaves_no_engine_and_key_is_on_no_argv(tmp_path, backend):
    port, key = free_port(), "k-" + os.urandom(8).hex()
    proc = subprocess.Popen(_cli("serve", "--backend", backend, "--config", _config(tmp_path, port, key),
                                 "--log-dir", str(tmp_path / "logs")), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "serve.err", "w"), text=True)
    try:
        line = proc.stdout.readline().strip()  # printed once every engine is admitted
        assert line == f"127.0.0.1:{port}", (tmp_path / "serve.err").read_text()[-3000:]
        engines = _engine_procs(port)
        assert engines, "no engine process found by its owner mark"
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert key not in ps and not any(key in c for c in engines.values())
        assert key not in (tmp_path / "serve.err").read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        end = time.monotonic() + 30
        while _engine_procs(port) and time.monotonic() < end:
            time.sleep(0.5)
        assert _engine_procs(port) == {}, f"engines outlived `serve --backend {backend}` killed with -9"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _engine_procs(port):
            os.kill(pid, signal.SIGKILL)
