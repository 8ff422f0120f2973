"""`serve` on a REAL SGLang 0.5.23 CPU engine (tiny-cpu, one engine, routed experts on): a consumer reads the
groups serve rolls out (`GET /groups`) while it asks for a weight update from disk (`POST /update_weights`, another
checkpoint of the tiny model) in the middle of the rollout. Every group arrives once; none was aborted, re-sent or
started again (every sample one attempt, no resume); a sample that was in flight across the update names both
versions in its `weight_version_spans`. The stand-in version of this scenario: tests/test_weight_update_stream.py.

The update lands inside requests whatever the machine's speed: once the first group is read, the consumer sends
the engine one request of `PROBE` tokens of its own and asks for the update when it is answered; the requests
serve sent before it ran in the same decode steps, so each has `PROBE` tokens more and still has tokens to go.
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from rollout.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW, PROBE, GROUPS = 64, 8, 6


def _http(method, url, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_serve_consumer_across_a_disk_weight_update(tmp_path, tiny_model):
    from rollout.models.tiny import build_tiny_glm

    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    with open(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")) as fh:
        d = yaml.safe_load(fh)
    d["engine_groups"][0]["engines"] = 1
    d["model"]["path"] = tiny_model
    d["rollout"].update(base_port=31780, concurrency_per_engine=4)   # two groups of two in flight at a time
    d["rollout"]["sampling"]["max_new_tokens"] = NEW
    d["rollout"]["budgets"].update(http_s=400, server_up_s=300)     # a loaded machine starts slowly
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(d))
    port = free_port()
    err = tmp_path / "serve.err"
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "serve", "--config", str(cfg), "--log-dir",
                             str(tmp_path / "logs"), "--control-port", str(port), "--num-groups", str(GROUPS)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
    try:
        addr = proc.stdout.readline().strip()   # once the engine is admitted
        assert addr == "127.0.0.1:31780", err.read_text()[-3000:]
        engine, control = f"http://{addr}", f"http://127.0.0.1:{port}"
        assert _http("GET", f"{engine}/server_info")["version"] == "0.5.23"
        seen, after, updated, end = [], 0, None, time.monotonic() + 600
        while time.monotonic() < end:
            body = _http("GET", f"{control}/groups?after={after}&max=4&wait_s=30")
            if body["done"]:
                break
            seen += body["groups"]
            after = body["next"]
            if updated is None and body["groups"]:
                _http("POST", f"{engine}/generate", {"input_ids": [11, 12, 13, 14], "sampling_params": {
                    "max_new_tokens": PROBE, "min_new_tokens": PROBE, "temperature": 0}})
                updated = _http("POST", f"{control}/update_weights", {"model_path": other, "weight_version": "1"})
        assert body["done"] and body["error"] is None, (body, err.read_text()[-3000:])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
    log = err.read_text()
    assert rc == 0, log[-3000:]
    assert updated["weight_version"] == "1" and updated["engines"] == ["tiny-0"], updated
    assert [g["seq"] for g in seen] == list(range(1, GROUPS + 1))
    assert len({g["group_id"] for g in seen}) == GROUPS
    samples = [s for g in seen for s in g["samples"]]
    bad = [(s["sample_id"], s["status"], s["error"], s["attempts"], s["resumes"]) for s in samples
           if s["status"] not in ("completed", "truncated") or s["attempts"] != 1 or s["resumes"] != 0]
    assert not bad, bad   # nothing aborted, re-sent or started again
    both = [s for s in samples if [x["version"] for x in s["weight_version_spans"]] == ["default", "1"]]
    assert both, [s["weight_version_spans"] for s in samples]
    for s in both:
        spans = s["weight_version_spans"]
        assert spans[0]["start"] == 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == s["response_len"]
    for g in seen:   # routed experts kept for every token, across the retraction too (the dispatcher checked them)
        assert all(s["routed_experts"]["shape"][0] == len(g["prompt_ids"]) + s["response_len"] - 1
                   for s in g["samples"]), g["group_id"]
    assert f"rollout done: {GROUPS} group(s) delivered, 0 request(s) re-sent, 0 sample(s) failed" in log, log[-3000:]
    print(f"\nserve across a weight update: {GROUPS} groups once, {len(both)} sample(s) spanning versions default "
          f"and 1, update {updated['seconds']} s, 0 aborted / re-sent / regenerated")
