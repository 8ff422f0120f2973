"""`run` stops cleanly: a write error (a real EFBIG from RLIMIT_FSIZE, as a full disk gives ENOSPC) ends the
rollout at once with one line naming the file and the OS error, exit 1, the engines stopped, every line
whole, and `--resume` finishes the run; SIGTERM/SIGINT stop the engines and exit 143/130. The engine is a
STAND-IN (tests/support/run_standin.py: a FAKE SGLang HTTP server); the CLI, stream, log and manager are real.
Where a tmpfs can be mounted (root), a really full disk (ENOSPC), with the stand-in and (e2e) a real engine."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "support", "run_standin.py")
N = 40   # groups: 5x what the manager keeps in flight (8), so a run that does not stop shows it


class FullDisk:
    """A small real filesystem (tmpfs) filled by one file but for `room` bytes; `free()` deletes that file."""

    def __init__(self, root):
        self.root, self.filler = root, root / "filler"

    def fill(self, room: int) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        os.truncate(self.filler, max(0, os.path.getsize(self.filler) - room))

    def free(self) -> None:
        os.unlink(self.filler)


@pytest.fixture
def full_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                            capture_output=True).returncode
    except FileNotFoundError:
        rc = 1
    if rc:
        pytest.skip("cannot mount a tmpfs here (needs root); the RLIMIT_FSIZE test covers the path")
    try:
        yield FullDisk(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _config(tmp_path, **rollout):
    with open(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")) as fh:
        d = yaml.safe_load(fh)
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["engine_groups"][0]["routed_experts"] = False   # the stand-in sends no routed experts
    d["rollout"].update(rollout)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def _run(argv, env=None, **kw):
    return subprocess.Popen([sys.executable, DRIVER, "run", *argv], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **(env or {})}, **kw)


def _ids(out):
    return [json.loads(x)["group_id"] for x in out.read_text().splitlines()]   # every line is whole JSON


def _calls(err):
    line = [x for x in err.splitlines() if x.startswith("STANDIN: stopped after")]
    assert len(line) == 1, err          # the manager's stop() ran (it closes the engines)
    return int(line[0].split()[3])


def test_write_error_stops_the_run_at_once_then_resume_finishes_it(tmp_path):
    out, n = tmp_path / "o.jsonl", 2 * N     # a full run: 3 calls per group (its primer, 2 samples)
    p = _run(["--config", _config(tmp_path), "--output", str(out), "--num-groups", str(n)],
             env={"STANDIN_FSIZE": "2500", "STANDIN_DELAY_S": "0.2"})   # room for 2 lines of ~1 kB
    _, err = p.communicate(timeout=90)
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert p.returncode == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write to {out}: File too large (errno 27); "
                                                     f"2 line(s) of this run written whole"), err
    assert errors[0].endswith(f"continue with: slime-moe-rollout run --resume {out}")
    assert _calls(err) < n, err         # stopped at once: a third of a full run at most (the groups in flight
    first = _ids(out)                   # when the write failed, their primers, under load a few more)
    assert len(first) == 2
    p = _run(["--resume", str(out)])    # space freed
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    ids = _ids(out)
    assert ids[:2] == first and len(ids) == len(set(ids)) == n


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_the_engines_and_keeps_the_output_whole(tmp_path, sig, rc):
    out = tmp_path / "o.jsonl"
    p = _run(["--config", _config(tmp_path), "--output", str(out), "--num-groups", str(N)],
             env={"STANDIN_DELAY_S": "0.3"})
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().count("\n") >= 1):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == rc, err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("stopped by")]
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {sig.name}: "), err
    assert f"in {out}, engines stopped; continue with: slime-moe-rollout run --resume {out}" in lines[0]
    _calls(err)
    ids = _ids(out)
    assert 1 <= len(ids) < N and len(ids) == len(set(ids))


def _stops_on_a_full_disk_then_resumes(tmp_path, disk, argv, n, driver_env=None, cli=None, cli_env=None):
    out, logs = disk.root / "o.jsonl", tmp_path / "logs"
    run = (lambda a, **kw: _run(a, **kw)) if cli is None else (
        lambda a, env=None: subprocess.Popen([cli, "run", *a], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, env={**os.environ, **cli_env}))
    disk.fill(room=8192)   # a page for OUTPUT.run.json, a page (about 4 lines) for OUTPUT
    p = run([*argv, "--output", str(out), "--num-groups", str(n), "--log-dir", str(logs)], env=driver_env)
    _, err = p.communicate(timeout=900)
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert p.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write to {out}: No space left on device "
                                                     f"(errno 28); "), err[-3000:]
    first = _ids(out)   # every line whole
    assert len(first) < n and f"{len(first)} line(s) of this run written whole" in errors[0]
    disk.free()
    p = run(["--resume", str(out), "--log-dir", str(logs)])
    _, err2 = p.communicate(timeout=900)
    assert p.returncode == 0, err2[-3000:]
    ids = _ids(out)
    assert ids[:len(first)] == first and len(ids) == len(set(ids)) == n
    return err


def test_full_disk_stops_the_run_then_resume_finishes_it(tmp_path, full_disk):
    n = 2 * N   # a full run: 3 calls per group (its primer, 2 samples)
    err = _stops_on_a_full_disk_then_resumes(tmp_path, full_disk, ["--config", _config(tmp_path)], n,
                                             {"STANDIN_DELAY_S": "0.2"})
    assert _calls(err) < n      # stopped at once: a third of a full run at most


@pytest.mark.e2e
@pytest.mark.timeout(1800)   # two engine starts on a loaded 2-core machine
def test_full_disk_real_engine_stops_leaves_no_engine_and_resumes(tmp_path, full_disk):
    """A real SGLang CPU engine: a full disk ends `run` with one line, its engine is gone, resume finishes."""
    from rollout.net import free_port

    base = free_port()
    cfg = _config(tmp_path, base_port=base)
    d = yaml.safe_load(open(cfg))
    d["engine_groups"][0].update(engines=1, routed_experts=True)
    d["rollout"]["budgets"].update(http_s=600, server_up_s=600, health_generate_s=600)   # a loaded machine
    open(cfg, "w").write(yaml.safe_dump(d))
    cli = os.path.join(os.path.dirname(sys.executable), "slime-moe-rollout")
    _stops_on_a_full_disk_then_resumes(tmp_path, full_disk, ["--config", cfg], 12, cli=cli,   # own JIT cache:
                                       cli_env={"SGLANG_CACHE_DIR": str(tmp_path / "cache")})  # a shared one can be torn
    left = subprocess.run(["pgrep", "-f", "--", f"--port {base}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "an engine of the failed run is still running"
