"""scripts/check_against_slime.sh's plumbing, without engines or slime: what it hands its driver.

`serve` and slime's client Python are STAND-INs here (the real run is tests/test_slime_check_engines.py,
e2e): the engine Python is this project's venv except for `-m rollout.cli serve`, which prints two addresses
and waits as serve does; the slime Python accepts the import probes and, as the driver, prints its
arguments as an [ok] line. The config's model path and the version probe are resolved for real.
"""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVE_STANDIN = """#!/usr/bin/env bash
# STAND-IN for `serve`: addresses on stdout, then wait to be stopped; anything else is the real Python
if [ "$1 $2 $3" = "-m rollout.cli serve" ]; then echo "127.0.0.1:1 127.0.0.1:2"; exec sleep 60; fi
exec {python} "$@"
"""
DRIVER_STANDIN = """#!/usr/bin/env bash
# STAND-IN for slime's client Python: the import probes pass; the driver prints what it was given
case "$1" in -c) exit 0 ;; *check_against_slime.py) shift; echo "[ok] driver: $*" ;; *) exit 3 ;; esac
"""


def _exe(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def test_the_driver_gets_the_config_its_model_path_and_serves_addresses(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")) as fh:
        text = fh.read().replace("path: .cache/tiny-glm45", f"path: {model}")
    config = tmp_path / "tiny.yaml"
    config.write_text(text)
    (tmp_path / "slime" / "slime").mkdir(parents=True)
    env = dict(os.environ, ENGINE_LOCK="", CONFIG=str(config), BUDGET_S="60",
               ENGINE_PYTHON=_exe(tmp_path / "engine-python", SERVE_STANDIN.format(python=sys.executable)),
               SLIME_PYTHON=_exe(tmp_path / "slime-python", DRIVER_STANDIN))
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_against_slime.sh"), str(tmp_path / "slime")],
                       env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"[ok] driver: {config} {model} 127.0.0.1:1 127.0.0.1:2\n" in p.stdout, p.stdout
    assert "all slime checks passed against 127.0.0.1:1 127.0.0.1:2" in p.stdout


def test_a_slime_python_without_slime_is_named_in_one_line(tmp_path):
    (tmp_path / "slime" / "slime").mkdir(parents=True)
    env = dict(os.environ, ENGINE_LOCK="", SLIME_PYTHON=_exe(tmp_path / "python", "#!/bin/sh\nexit 1\n"))
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_against_slime.sh"), str(tmp_path / "slime")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr == (f"error: SLIME_PYTHON {tmp_path / 'python'} cannot import sglang and "
                                              "slime (this script's header says how to build it)\n"), p.stderr
