"""Per-release subprocess work (scenario runs, `patches status`, patched trees), done once per session and two
at a time: asking for one release's result also starts the next release's in the background, so both cores
work while the tests of the current release run. A result is computed in a worker thread; what it raises
(a skip, a failure) is raised again in the test that asks for it."""
import os
import sys
import threading
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_patches.registry import VARIANTS
from sglang_patches.scenarios.runner import env_python, run_states

ALL = [v.name for v in VARIANTS]                     # every reviewed release, 0.5.23 (the main environment) last
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
