"""Scenario lists: the in-process harness, and running a list in fresh processes.

A scenario module (`sglang_patches.scenarios.dp`) calls `main(SCENARIOS, state)` when run as
`python -m <module> STATE` (plugin / none / source / both); it prints one JSON object
{scenario: {"ok": bool, "detail": str}}. `run_states` runs one process per state, in any environment's
interpreter (the version matrix and `patches review` pass `.venvs/sglang-<variant>/bin/python`).
"""
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (version environments live in ROOT/.venvs)
MARK = "DP_SCENARIOS_JSON "


def registry():
    """(SCENARIOS, decorator): `@scenario` adds a function to SCENARIOS under its name."""
    scenarios = {}

    def scenario(fn):
        scenarios[fn.__name__] = fn
        return fn

    return scenarios, scenario


def run_all(scenarios: dict) -> dict:
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - a crash is a scenario outcome
            out[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc(limit=-3)}
    return out


def main(scenarios: dict, state: str, meta: dict = None) -> None:
    """Run `scenarios` in `state`: "plugin", "none", "source", or "both": stock first, then SGLang's own
    load_plugins() in this same process (it patches the hooked targets in place) and the list again."""
    if state in ("none", "source"):
        os.environ["SGLANG_PLUGINS"] = "none"
    from sglang.srt.plugins import load_plugins

    from sglang_patches import plugin

    if state == "both":
        os.environ.pop("SGLANG_PLUGINS", None)
        stock = run_all(scenarios)
        stock["_meta"] = {"state": "none", "registered": list(plugin._registered), **(meta or {})}
    load_plugins()  # SGLang's own entry-point discovery, as in every server process
    results = run_all(scenarios)
    import sglang

    results["_meta"] = {"state": "plugin" if state == "both" else state, "registered": list(plugin._registered),
                        "sglang_path": sglang.__file__, **(meta or {})}
    out = {"none": stock, "plugin": results} if state == "both" else results
    print(MARK + json.dumps(out))


def env_python(variant: str) -> Path:
    """The interpreter of a version-matrix environment (scripts/setup_sglang_env.sh VARIANT)."""
    return ROOT / ".venvs" / f"sglang-{variant}" / "bin" / "python"


def run_states(states, *, module="sglang_patches.scenarios.dp", python=None, extra_env=None, timeout=300) -> dict:
    """{state: results}; states run concurrently, each in its own interpreter ("both": one interpreter
    answers "none" and "plugin")."""
    procs = {}
    for state in states:
        env = dict(os.environ)
        env.pop("SGLANG_PLUGINS", None)
        env.pop("SLIME_MOE_ROLLOUT_DISABLE", None)
        env.update((extra_env or {}).get(state, {}))
        # this package's root after the caller's path: the scenario module is this checkout's, whatever is installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
        procs[state] = subprocess.Popen(
            [str(python or sys.executable), "-m", module, state], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    out = {}
    for state, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        line = next((ln for ln in stdout.splitlines() if ln.startswith(MARK)), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"scenario process '{state}' failed (rc {p.returncode}):\n{stderr[-3000:]}")
        got = json.loads(line[len(MARK):])
        out.update(got if state == "both" else {state: got})
    return out
