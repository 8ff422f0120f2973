"""The device (GPU) checks: one judged line each, `gpu-check NAME: PASS|FAIL|SKIP reason`.

Run by scripts/gpu_check/run.sh after the carried wheels are installed (PYTHONPATH=<site>:<repo>).
Each check runs in its own process with a timeout. Exit status: 1 if any check FAILs.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = []


def judge(name: str, verdict: str, reason: str) -> None:
    RESULTS.append(verdict)
    print(f"gpu-check {name}: {verdict} {reason}", flush=True)


def py(args, timeout, env=None, **kw):
    """Run python with `args` under a timeout; (rc, stdout, stderr); rc 124 on timeout."""
    try:
        p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})}, **kw)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return 124, e.stdout or "", f"timed out after {timeout}s"


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_cpu_hook_decision():
    """setup_venv.sh's own decision snippet, run with this machine's torch: no CPU hook with a usable GPU."""
    from sglang_patches.cpu import env

    text = (ROOT / "scripts/setup_venv.sh").read_text()
    snippet = re.search(r'"\$VENV/bin/python" -c "\n(.*?)\n"\n', text, re.S).group(1)
    rc, out, err = py(["-c", snippet], 60)
    import torch

    facts = f"torch {torch.__version__} (cuda {torch.version.cuda}), cuda.is_available() {torch.cuda.is_available()}"
    if rc != 0:
        return judge("cpu_hook_decision", "FAIL", f"setup's snippet failed rc {rc}: {err.strip()[-300:]}")
    installed = "setup: CPU hook at" in out
    if not cuda():
        return judge("cpu_hook_decision", "SKIP", f"no CUDA device; {facts}; setup's snippet installed the "
                     f"hook: {installed} (expected True here)")
    if installed:
        env.remove()  # the remaining checks must not run under the CPU hook
        return judge("cpu_hook_decision", "FAIL", f"setup's snippet installed the CPU hook on a GPU machine; {facts}")
    judge("cpu_hook_decision", "PASS", f"no CPU hook; {facts}; {torch.cuda.get_device_name(0)}")


def check_capture_snapshot():
    """sglang#34319 on CUDA: stock 0.5.15.post1 stores the next forward's row; our plugin's hook stores the right one."""
    from capture_race import STOCK, WANT  # noqa: F401  (scripts/gpu_check on sys.path)
    from sglang_patches.scenarios.runner import MARK

    res = {}
    for state in ("none", "plugin"):
        rc, out, err = py(["scripts/gpu_check/capture_race.py", state], 150, env={"SGLANG_PLUGINS": ""})
        line = next((ln for ln in out.splitlines() if ln.startswith(MARK)), None)
        if rc != 0 or line is None:
            return judge("capture_snapshot_cuda", "FAIL", f"state {state}: rc {rc}: {err.strip()[-1500:]}")
        res[state] = json.loads(line[len(MARK):])
        print(f"  {state}: sglang {res[state]['_meta']['sglang_path']}, registered {res[state]['_meta']['registered']}; "
              + "; ".join(f"{k}: {v['detail']}" for k, v in res[state].items() if k != "_meta"), flush=True)
    none, plug = res["none"]["capture_race_delayed_copy"], res["plugin"]["capture_race_delayed_copy"]
    if none.get("skip") or plug.get("skip"):
        return judge("capture_snapshot_cuda", "SKIP", "no CUDA device (the scenario imports and runs up to CUDA)")
    hooked = "capture-snapshot" in res["plugin"]["_meta"]["registered"]
    undelayed = f"undelayed stock: {res['none']['capture_race_undelayed']['detail']}"
    if not hooked or res["none"]["_meta"]["registered"]:
        return judge("capture_snapshot_cuda", "FAIL", f"plugin states wrong: {res['none']['_meta']['registered']} / "
                     f"{res['plugin']['_meta']['registered']}")
    if none["rows"] != STOCK:
        return judge("capture_snapshot_cuda", "FAIL", f"stock rows {none['rows']}, expected the race's {STOCK}; {undelayed}")
    if plug["rows"] != WANT:
        return judge("capture_snapshot_cuda", "FAIL", f"with the fix rows {plug['rows']}, want {WANT}")
    judge("capture_snapshot_cuda", "PASS", f"stock {none['rows']} (race), fixed {plug['rows']}; {undelayed}")


def check_megatron_replay():
    """The R3 replay (megatron_replay.py, which tests/test_routed_experts_megatron.py runs on CPU) on CUDA, nccl."""
    if not cuda():
        return judge("megatron_replay_cuda", "SKIP", "no CUDA device")
    rc, out, err = py(["scripts/gpu_check/megatron_replay.py", "cuda"], 300)
    if rc != 0:
        return judge("megatron_replay_cuda", "FAIL", f"rc {rc}: {(out + err).strip()[-1500:]}")
    judge("megatron_replay_cuda", "PASS", out.strip().splitlines()[0])


def check_cuda_branches():
    rc, out, err = py(["scripts/gpu_check/cuda_branches.py"], 120)
    if rc != 0:
        return judge("cuda_branches", "FAIL", f"rc {rc}: {err.strip()[-1500:]}")
    print(out, end="", flush=True)
    res = json.loads(out.strip().splitlines()[-1])
    if res.get("skip"):
        return judge("cuda_branches", "SKIP", res["skip"])
    bad = {k: v for k, v in res.items() if not v["ok"]}
    judge("cuda_branches", "FAIL" if bad else "PASS", json.dumps(bad or {k: v["detail"] for k, v in res.items()}))


def check_kernel_ops_cuda():
    """The kernel substitute's CUDA-named torch ops against SGLang's native code, on CUDA tensors."""
    if not cuda():
        return judge("kernel_ops_cuda", "SKIP", "no CUDA device")
    rc, out, err = py(["scripts/gpu_check/ops_check.py", "cuda"], 90)
    if rc != 0:
        return judge("kernel_ops_cuda", "FAIL", f"rc {rc}: {err.strip()[-1500:]}")
    res = json.loads(out.strip().splitlines()[-1])
    bad = {k: v["detail"] for k, v in res.items() if not v["ok"]}
    judge("kernel_ops_cuda", "FAIL" if bad else "PASS", json.dumps(bad) if bad else f"{len(res)} ops equal SGLang's native")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from plan import register_entry_point

    register_entry_point(sys.argv[1])  # run.sh's install did it too (idempotent)
    for check in (check_cpu_hook_decision, check_capture_snapshot, check_megatron_replay, check_cuda_branches,
                  check_kernel_ops_cuda):
        try:
            check()
        except Exception as e:  # noqa: BLE001 - a crash of the harness is that check's FAIL
            judge(check.__name__.removeprefix("check_"), "FAIL", f"harness: {type(e).__name__}: {e}")
    sys.exit(1 if "FAIL" in RESULTS else 0)
