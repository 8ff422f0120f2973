"""slime's own weight update against a real SGLang CPU engine with requests in flight (e2e: one engine per release).

slime 624b824's `SGLangEngine` methods (unmodified, on an instance that is not launched: only its address is set)
run in slime's Python (SLIME_PYTHON, SLIME_SRC) with the disk path's sequence, `update_weight_from_disk_delta.py`:
`pause_generation()` (an empty body), `flush_cache()`, `update_weights_from_disk(model_path=, weight_version=)`,
`continue_generation()`. The engine serves the tiny GLM-4.5 with routed experts (preset a) on each release, from
that release's environment; three streamed requests are in flight when slime pauses, and the update loads another
checkpoint (seed 1). With the plugin (weight-update-pause, its default mode for an engine with routed experts):
0 aborted, every request finishes with all its tokens, retracted once, under the new version. Stock SGLang aborts
all three at the pause (sglang_patches/scenarios/weight_update.py shows why on every release).

This file's `__main__` is the child that runs one release's engine and prints JSON.
"""
import json
import os
import subprocess
import sys

import pytest
from support.variant_runs import python_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLIME_PYTHON = os.environ.get("SLIME_PYTHON", "/tmp/venv-slime/bin/python")
SLIME_SRC = os.environ.get("SLIME_SRC", "/tmp/slime-src")
BEFORE, NEW = 6, 160   # tokens each request has when slime pauses; max_new_tokens
PROMPTS = [[10 + (i * 37 + j * 11) % 180 for j in range(12)] for i in range(3)]

# slime's own client: its SGLangEngine's update calls, as update_weight_from_disk_delta.py sends them
SLIME_CLIENT = """
import json, sys, time
from slime.backends.sglang_utils.sglang_engine import SGLangEngine
host, port, model_path, version = sys.argv[1:5]
engine = object.__new__(SGLangEngine)   # not launched: slime's methods on an engine at host:port
engine.node_rank, engine.server_host, engine.server_port = 0, host, int(port)
print("ready", flush=True)
sys.stdin.readline()
out, t0 = {}, time.monotonic()
engine.pause_generation()
engine.flush_cache()
out["update"] = engine.update_weights_from_disk(model_path=model_path, weight_version=version)
engine.continue_generation()
out["seconds"] = time.monotonic() - t0
print("SLIME " + json.dumps(out), flush=True)
"""


def _slime_client(host, port, model_path, version):
    env = dict(os.environ, PYTHONPATH=SLIME_SRC)
    p = subprocess.Popen([SLIME_PYTHON, "-c", SLIME_CLIENT, host, str(port), model_path, version], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"slime's client did not start: {line!r} {p.stderr.read()[-2000:]}")
    return p


def _stream(url, seen, last, i):
    import requests

    body = {"input_ids": PROMPTS[i], "stream": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
            if r.status_code != 200:
                last[i] = {"error": r.text[:300]}
                return
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    last[i] = json.loads(line[6:])
                    seen[i] = len(last[i].get("output_ids") or [])
    except Exception as e:  # noqa: BLE001 - reported in the answer
        last[i] = {"error": f"{type(e).__name__}: {e}"}


def run_child(model: str, other: str, budget_s: float) -> dict:
    """One engine of this interpreter's SGLang; three requests in flight across slime's update; JSON facts."""
    import tempfile
    import threading
    import time

    from support.engines import active_fixes, preset, start_engine, stop_engine

    spec = preset("a", model, api_key="")   # keyless: slime's client sends no key
    eng = start_engine(spec, tempfile.mkdtemp(prefix="engine-wup-"), budget_s)
    try:
        host, port = eng.url.split("//")[1].rsplit(":", 1)
        client = _slime_client(host, port, other, "2")
        seen, last = [0] * len(PROMPTS), [None] * len(PROMPTS)
        threads = [threading.Thread(target=_stream, args=(eng.url, seen, last, i), daemon=True)
                   for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while min(seen) < BEFORE and time.monotonic() - t0 < 300 and all(b is None or "error" not in b for b in last):
            time.sleep(0.02)
        at_pause = list(seen)
        stdout, stderr = client.communicate("go\n", timeout=300)
        for t in threads:
            t.join(timeout=600)
        slime = next((json.loads(ln[6:]) for ln in stdout.splitlines() if ln.startswith("SLIME ")), None)
        answers = [{"error": b["error"]} if b is None or "error" in b else
                   {"tokens": len(b["output_ids"]), "finish": b["meta_info"]["finish_reason"],
                    "weight_version": b["meta_info"].get("weight_version"),
                    "weight_versions": b["meta_info"].get("weight_versions"),
                    "num_retractions": b["meta_info"].get("num_retractions")} for b in last]
        return {"fixes": active_fixes(eng), "at_pause": at_pause, "slime": slime,
                "slime_stderr": "" if slime else stderr[-3000:], "answers": answers}
    finally:
        left = stop_engine(eng)[1]
        assert not left, f"engine processes left: {left}"


def _run(variant, tiny_model, tmp_path):
    from rollout.models.tiny import build_tiny_glm

    if not os.path.exists(SLIME_PYTHON) or not os.path.isdir(os.path.join(SLIME_SRC, "slime")):
        pytest.skip(f"slime's Python ({SLIME_PYTHON}) or source ({SLIME_SRC}) missing")
    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    py = python_of(variant)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    r = subprocess.run([str(py), os.path.abspath(__file__), tiny_model, other, "480"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", ["0.5.23", "0.5.15.post1"])
def test_slime_update_keeps_requests_in_flight(variant, tiny_model, tmp_path):
    out = _run(variant, tiny_model, tmp_path)
    assert "weight-update-pause" in out["fixes"], out["fixes"]
    assert out["slime"] is not None, out["slime_stderr"]
    assert out["slime"]["update"]["success"], out["slime"]
    assert min(out["at_pause"]) >= BEFORE and max(out["at_pause"]) < NEW, out["at_pause"]
    aborted = [a for a in out["answers"] if "error" in a or a["finish"]["type"] == "abort"]
    assert not aborted, out["answers"]
    for a in out["answers"]:
        assert a["tokens"] == NEW and a["finish"]["type"] == "length", a
        assert a["num_retractions"] >= 1 and a["weight_version"] == "2", a
    print(f"SGLang {variant}: paused at {out['at_pause']} tokens, slime's update took {out['slime']['seconds']:.1f} s, "
          f"0 of {len(out['answers'])} aborted, each finished {NEW} tokens under version 2")


if __name__ == "__main__":
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    print(json.dumps(run_child(sys.argv[1], sys.argv[2], float(sys.argv[3]))))
