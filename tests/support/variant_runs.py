"""Per-release subprocess work (scenario runs, `patches status`, patched trees), done once per session and two
at a time: asking for one release's result also starts the next release's in the background, so both cores
work while the tests of the current release run. A result is computed in a worker thread; what it raises
(a skip, a failure) is raised again in the test that asks for it."""
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_patches.registry import VARIANTS
from sglang_patches.scenarios.runner import ROOT, env_python, run_states

ALL = [v.name for v in VARIANTS]   # every reviewed release, in the registry's order (0.5.23, the main environment, first)
REQUIRED = set(os.environ.get("SLIME_MOE_ROLLOUT_MATRIX", "").split())   # `make test` lists the ones it built
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="release-run")
_FUTURES: dict = {}
_LOCK = threading.Lock()


def python_of(variant: str):
    """The release's interpreter (0.5.23: this one); a missing environment fails when `make test` built it,
    else skips."""
    if variant == "0.5.23":
        return Path(sys.executable)
    py = env_python(variant)
    if not py.exists():
        if variant in REQUIRED:
            pytest.fail(f"{py} missing: run scripts/setup_sglang_env.sh {variant}")
        pytest.skip(f"no environment for SGLang {variant} (scripts/setup_sglang_env.sh {variant})")
    return py


def ahead(kind: str, fn, variant: str, order=ALL):
    """fn(variant), computed once under `kind`; starts fn on the release after `variant` in `order` too."""
    with _LOCK:
        todo = [variant]
        if variant in order:
            todo += order[order.index(variant) + 1:order.index(variant) + 2]
        for v in todo:
            if (kind, v) not in _FUTURES:
                _FUTURES[(kind, v)] = _POOL.submit(fn, v)
        fut = _FUTURES[(kind, variant)]
    return fut.result()


def _every(variant: str) -> dict:
    return run_states(["both"], module="sglang_patches.scenarios.every", python=python_of(variant), timeout=600)


def scenarios(variant: str) -> dict:
    """{"none": ..., "plugin": ...}: every scenario list (sglang_patches.scenarios.every) on the release."""
    return ahead("scenarios", _every, variant)


STATUS_ENV = {"plain": {}, "cpu": {"SGLANG_USE_CPU_ENGINE": "1"},
              "graphs": {"SGLANG_USE_CPU_ENGINE": "1", "SLIME_MOE_ROLLOUT_CPU_GRAPHS": "1"}}
# `patches status --json` (the CLI's own main) once per STATUS_ENV setting, in one interpreter
_STATUS = """
import contextlib, io, json, os, sys
from rollout.cli import main
out, base = {}, dict(os.environ)
for kind, env in json.loads(sys.argv[1]).items():
    os.environ.clear(); os.environ.update(base, **env)
    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        try:
            rc = main(["patches", "status", "--json"])
        except SystemExit as e:
            rc = e.code
    out[kind] = {"returncode": rc, "stdout": so.getvalue(), "stderr": se.getvalue()}
print("STATUS " + json.dumps(out))
"""


def _statuses(variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    r = subprocess.run([str(python_of(variant)), "-c", _STATUS, json.dumps(STATUS_ENV)], capture_output=True,
                       text=True, timeout=400, cwd=ROOT, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("STATUS ")), None)
    assert line, f"status probe failed on {variant}: {r.stderr[-2000:]}"
    return {k: SimpleNamespace(**v) for k, v in json.loads(line[len("STATUS "):]).items()}


def status(variant: str, kind: str = "plain"):
    """(process-like answer, report) of `patches status --json` on the release with STATUS_ENV[kind] set."""
    r = ahead("status", _statuses, variant)[kind]
    return r, json.loads(r.stdout)
