"""Run `dp_scenarios.py` in fresh processes (one per state) and collect their JSON results."""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "DP_SCENARIOS_JSON "


def run_states(states, *, extra_env=None, timeout=300) -> dict:
    """{state: results}; states run concurrently, each in its own interpreter."""
    procs = {}
    for state in states:
        env = dict(os.environ)
        env.pop("SGLANG_PLUGINS", None)
        env.pop("SLIME_MOE_ROLLOUT_DISABLE", None)
        env.update((extra_env or {}).get(state, {}))
        procs[state] = subprocess.Popen(
            [sys.executable, str(HERE / "dp_scenarios.py"), state],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    out = {}
    for state, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        line = next((ln for ln in stdout.splitlines() if ln.startswith(MARK)), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"scenario process '{state}' failed (rc {p.returncode}):\n{stderr[-3000:]}")
        out[state] = json.loads(line[len(MARK):])
    return out
