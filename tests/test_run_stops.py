"""`run` stops cleanly: a write error (a real EFBIG from RLIMIT_FSIZE, as a full disk gives ENOSPC) ends the
rollout at once with one line naming the file and the OS error, exit 1, the engines stopped, every line
whole, and `--resume` finishes the run; SIGTERM/SIGINT stop the engines and exit 143/130. The engine is a
STAND-IN (tests/support/run_standin.py: a FAKE SGLang HTTP server); the CLI, stream, log and manager are real."""
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


def _config(tmp_path):
    with open(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")) as fh:
        d = yaml.safe_load(fh)
    d["model"]["path"] = os.path.join(ROOT, d["model"]["path"])
    d["engine_groups"][0]["routed_experts"] = False   # the stand-in sends no routed experts
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
    out = tmp_path / "o.jsonl"
    p = _run(["--config", _config(tmp_path), "--output", str(out), "--num-groups", str(N)],
             env={"STANDIN_FSIZE": "2500", "STANDIN_DELAY_S": "0.2"})   # room for 2 lines of ~1 kB
    _, err = p.communicate(timeout=90)
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert p.returncode == 1 and "Traceback" not in err, err
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write to {out}: File too large (errno 27); "
                                                     f"2 line(s) of this run written whole"), err
    assert errors[0].endswith(f"continue with: slime-moe-rollout run --resume {out}")
    assert _calls(err) < N, err         # stopped at once: not every group generated for nothing (2 per group)
    first = _ids(out)
    assert len(first) == 2
    p = _run(["--resume", str(out)])    # space freed
    _, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    ids = _ids(out)
    assert ids[:2] == first and len(ids) == len(set(ids)) == N


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
