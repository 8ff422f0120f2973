"""`r3 check` end to end on REAL SGLang CPU engines serving the near-tie tiny GLM-4.5 (e2e).

1. One engine: the CLI starts it through the manager, replays shift-corrupted rows and fails (exit 1,
   "FAIL" in its table); the same real samples replayed as captured pass with replay cutting k3 KL
   at least 10x, while the trainer's own routing flips >= 1% of token-layers.
2. --url: attached to a running engine with NEXTN speculative decoding (rows from verify passes).
3. The seed's shape in miniature: DP attention tp 2 / dp 2, ep 2, dense-TP 1, DP lm-head, NEXTN; both
   DP ranks serve prompts (their log lines), and the replay of their captured rows passes the same bar.
Run under `flock /tmp/slime-engine.lock` on a shared machine.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "training_configs"


def _check(*args, timeout=1200):
    p = subprocess.run([sys.executable, "-m", "rollout.cli", "r3", "check", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    print(p.stderr[-1500:], file=sys.stderr)
    return p


def _judged(out: dict):
    assert out["pair"].startswith("rollout logprob") and "trainer recompute" in out["pair"]
    assert out["samples"] >= 8 and out["dtype"] == "bfloat16"
    assert out["own_routing"]["flip_rate"] >= 0.01, out["own_routing"]
    print(f"replayed arm's flip rate (0 by construction, a fact): {out['replayed_routing']['flip_rate']:.2%}")
    assert out["reduction"]["k3_kl"] >= 10 and out["reduction"]["mean_abs_diff"] >= 3, out["reduction"]


@pytest.mark.e2e
def test_r3_check_single_engine_and_corrupted_rows(tmp_path):
    model, saved = str(tmp_path / "near-tie"), str(tmp_path / "samples.json")
    bad = _check("--config", str(CONFIGS / "near-tie-cpu.yaml"), "--model", model,
                 "--corrupt", "shift", "--save-samples", saved, "--log-dir", str(tmp_path / "logs"))
    assert bad.returncode == 1, bad.stderr[-3000:]
    assert "FAIL: replay does not reduce the mismatch" in bad.stdout and "shift-corrupted" in bad.stdout
    ok = _check("--samples", saved, "--model", model, "--json")
    assert ok.returncode == 0, ok.stderr[-3000:]
    _judged(json.loads(ok.stdout))


@pytest.mark.e2e
def test_r3_check_url_of_a_running_nextn_engine(tmp_path):
    """--url: the manager attaches to an engine started elsewhere (here: routed experts + NEXTN, keyed)."""
    import os

    from support.engines import preset, start_engine, stop_engine
    from rollout.models.near_tie import build_near_tie_glm

    model = build_near_tie_glm(str(tmp_path / "near-tie"))
    eng = start_engine(preset("b", model), str(tmp_path / "logs"))
    try:
        os.environ["R3_TEST_ENGINE_KEY"] = eng.api_key
        p = _check("--url", eng.url, "--api-key-env", "R3_TEST_ENGINE_KEY", "--model", model, "--prompts", "6",
                   "--max-new-tokens", "24", "--json")
    finally:
        os.environ.pop("R3_TEST_ENGINE_KEY", None)
        _, left = stop_engine(eng)
        assert not left, f"processes left after stop: {left}"
    assert p.returncode == 0, p.stderr[-3000:]
    _judged(json.loads(p.stdout))


@pytest.mark.e2e
def test_r3_check_dp_attention_ep_nextn(tmp_path):
    model, logs = str(tmp_path / "near-tie"), tmp_path / "logs"
    p = _check("--config", str(CONFIGS / "near-tie-cpu-dpattn.yaml"), "--model", model,
               "--json", "--log-dir", str(logs))
    assert p.returncode == 0, p.stderr[-3000:]
    _judged(json.loads(p.stdout))
    log = (logs / "near-tie-dpattn-0.log").read_text(errors="replace")
    for rank in ("DP0", "DP1"):  # prompts (more than the 1-token readiness probe) prefilled on both ranks
        assert any(rank in ln and "Prefill batch" in ln and "#new-token: 1," not in ln for ln in log.splitlines()), rank
    assert re.search(r"speculative_algorithm': '(NEXTN|EAGLE)'", log)  # SGLang runs NEXTN as EAGLE
