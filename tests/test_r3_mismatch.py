"""R3's effect on recorded real-engine output, the metrics' definitions, and corrupted rows failing.

tests/facts/r3-near-tie-sglang-0.5.23.json was written by
`slime-moe-rollout r3 check --config training_configs/near-tie-cpu.yaml --save-samples ...`
against a REAL SGLang 0.5.23 CPU engine: 16 samples (prompt, response tokens, the engine's logprob of
each, its captured routed experts). The trainer side here is the real transformers forward.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollout.r3.check import RolloutSample, corrupted, evaluate, table
from rollout.r3.metrics import logprob_stats, mismatch, set_flips

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "tests" / "facts" / "r3-near-tie-sglang-0.5.23.json"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from rollout.models.near_tie import build_near_tie_glm, config_hash

    facts = json.loads(FACTS.read_text())
    seed = facts["meta"]["build"]["seed"]
    assert facts["meta"]["build"]["hash"] == config_hash(seed), "the near-tie builder changed: re-record the facts"
    path = build_near_tie_glm(str(tmp_path_factory.mktemp("nt") / "m"), seed=seed)
    return path, [RolloutSample.from_dict(d) for d in facts["samples"]]


@pytest.fixture(scope="module")
def model(recorded):
    from rollout.r3.replay import load_model

    return load_model(recorded[0], "bfloat16")


def test_metric_definitions():
    d = np.array([0.0, math.log(2) + 1e-9, -math.log(5) - 1e-9, 0.1])
    s = logprob_stats(d, np.zeros(4))
    assert s["k3_kl"] == pytest.approx(np.mean(np.exp(d) - 1 - d))
    assert s["mean_abs_diff"] == pytest.approx(np.abs(d).mean())
    assert s["extreme_frac_ln2"] == 0.5 and s["extreme_frac_ln5"] == 0.25
    a = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    b = np.array([[[2, 1], [3, 5]], [[5, 6], [7, 8]]])  # order within a set is no flip
    assert set_flips(a, b).tolist() == [[False, True], [False, False]]
    m = mismatch([np.zeros(2)], [np.zeros(2)], [a], [b])
    assert m.flip_rate == 0.25 and m.tokens_any_flip == 0.5 and m.flip_rate_per_layer == [0.0, 0.5]


def test_corruptions_keep_shapes_but_move_rows():
    rows = [np.arange(24).reshape(4, 2, 3), np.arange(100, 118).reshape(3, 2, 3)]
    shift = corrupted(rows, "shift")
    assert [r.shape for r in shift] == [r.shape for r in rows]
    assert np.array_equal(shift[0][1:], rows[0][:-1]) and np.array_equal(shift[0][0], rows[0][0])
    swap = corrupted(rows, "swap")
    assert [r.shape for r in swap] == [r.shape for r in rows]
    assert np.array_equal(swap[1], rows[0][:3]) and np.array_equal(swap[0][:3], rows[1])
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupted(rows, "nope")


@pytest.fixture(scope="module")
def report(model, recorded):
    return evaluate(model, recorded[1])


def test_replay_of_the_engine_rows_cuts_the_mismatch(report):
    rep = report
    assert rep.own.flip_rate >= 0.01, "the model is not near-tie against SGLang"
    # a fact, not a result: the replayed forward uses the captured sets, so its flip rate is 0 by construction
    print(f"replayed arm: flip rate {rep.replay.flip_rate:.2%}, tokens with any flip {rep.replay.tokens_any_flip:.2%}")
    assert rep.replay_reduces
    assert rep.ratios()["k3_kl"] >= 10 and rep.ratios()["mean_abs_diff"] >= 3, rep.as_dict()


@pytest.mark.parametrize("how", ["shift", "swap"])
def test_corrupted_rows_do_not_reduce_the_mismatch(model, recorded, report, how):
    rep = evaluate(model, recorded[1], corrupt=how, own=report.own)
    assert rep.replay.k3_kl >= rep.own.k3_kl and rep.replay.mean_abs_diff >= rep.own.mean_abs_diff
    assert rep.replay.flip_rate > rep.own.flip_rate  # flips are against the engine's true routing
    assert not rep.replay_reduces
    assert "FAIL: replay does not reduce the mismatch" in table(rep) and f"{how}-corrupted" in table(rep)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rollout.cli", "r3", "check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_cli_on_recorded_samples_says_which_pair_and_fails_on_corrupted_rows(recorded, tmp_path):
    path, facts = recorded[0], json.loads(FACTS.read_text())
    few = tmp_path / "few.json"  # 6 samples (3 prompts) keep the two CLI runs short
    few.write_text(json.dumps({"meta": facts["meta"], "samples": facts["samples"][:6]}))
    ok = _cli("--samples", str(few), "--model", path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "compares: rollout logprob" in ok.stdout and "vs trainer recompute" in ok.stdout
    assert "verdict: replay reduces the mismatch" in ok.stdout
    bad = _cli("--samples", str(few), "--model", path, "--corrupt", "shift", "--json")
    assert bad.returncode == 1, bad.stderr[-2000:]
    out = json.loads(bad.stdout)
    assert out["replay_reduces_mismatch"] is False and out["corrupt"] == "shift"
    assert out["pair"].startswith("rollout logprob") and set(out) >= {"own_routing", "replayed_routing", "reduction"}


def test_cli_bad_input_is_one_line(tmp_path):
    r = _cli("--samples", str(FACTS), "--model", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no config.json" in r.stderr
    r = _cli("--samples", str(FACTS))
    assert r.returncode == 2 and "--model is required" in r.stderr


def test_unknown_router_seam_is_refused_with_one_line(model):
    import torch

    from rollout.r3.replay import ReplaySeamError, moe_gates, routing_seam

    gate = moe_gates(model)[0]
    orig = gate.forward
    gate.forward = lambda h: orig(h)[0]  # an older transformers: the gate returns logits only
    try:
        with pytest.raises(ReplaySeamError, match="routing seam the replay does not know"):
            with torch.no_grad(), routing_seam(model, replay=[torch.zeros(1, 8, dtype=torch.long)] * 4):
                model(torch.tensor([[5, 6, 7]]))
    finally:
        del gate.forward


def test_benchmark_fails_as_model_not_near_tie_on_the_large_margin_model(tiny_model, tmp_path):
    """The large-margin tiny model never flips: its own forward as the 'rollout' gives flip rate 0."""
    from rollout.r3.replay import load_model, recompute

    m = load_model(tiny_model, "bfloat16")
    samples = []
    for k in range(3):
        prompt, response = list(range(5 + k, 60, 7)), list(range(100 + k, 160, 9))
        own = recompute(m, prompt, response)
        samples.append(RolloutSample(prompt, response, list(own.logprobs + 0.01), own.routing).as_dict())
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps({"meta": {}, "samples": samples}))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "r3_effect.py"), "--samples", str(f),
                        "--model", tiny_model], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 3, p.stderr[-2000:]
    assert "r3_effect.near_tie_flip_rate: ratio 0.000 (target >= 0.01) MISS" in p.stdout
    assert "r3_effect: model not near-tie" in p.stdout
