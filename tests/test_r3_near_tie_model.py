"""The near-tie tiny GLM-4.5: shape, determinism, and the two properties routing replay needs.

Its flip rate against a real SGLang engine is measured by `r3 check` (tests/test_r3_check_engine.py,
recorded in tests/facts/r3-near-tie-sglang-0.5.23.json and checked in tests/test_r3_mismatch.py).
"""
import hashlib
import json
import os

import numpy as np
import pytest

from rollout.near_tie_model import NUM_LAYERS, build_near_tie_glm, config_hash


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory):
    return build_near_tie_glm(str(tmp_path_factory.mktemp("nt") / "m"))


@pytest.fixture(scope="module")
def model(near_tie):
    from rollout.r3.replay import load_model

    return load_model(near_tie, "bfloat16")


def _digest(path):
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_shape_is_what_r3_needs(near_tie):
    cfg = json.load(open(os.path.join(near_tie, "config.json")))
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["n_routed_experts"] >= 64 and cfg["num_experts_per_tok"] == 8
    assert cfg["n_group"] > 1 and 1 <= cfg["topk_group"] < cfg["n_group"]
    assert cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] >= 4
    assert cfg["num_nextn_predict_layers"] == 1
    from safetensors import safe_open

    with safe_open(os.path.join(near_tie, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert str(f.get_tensor("model.layers.1.mlp.experts.0.up_proj.weight").dtype) == "torch.bfloat16"
    mtp = f"model.layers.{NUM_LAYERS}."
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "mlp.gate.weight", "mlp.experts.63.down_proj.weight"):
        assert mtp + name in keys


def test_build_is_deterministic_and_idempotent(tmp_path, near_tie):
    p = build_near_tie_glm(str(tmp_path / "m"))
    assert _digest(p) == _digest(near_tie)
    mtime = os.path.getmtime(os.path.join(p, "model.safetensors"))
    assert build_near_tie_glm(p) == p and os.path.getmtime(os.path.join(p, "model.safetensors")) == mtime
    assert config_hash(0) != config_hash(1)


def test_transformers_loads_every_weight(near_tie):
    import torch
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(near_tie, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith(f"model.layers.{NUM_LAYERS}.") for k in info["unexpected_keys"])


def test_routers_sit_near_ties(model):
    """The gap between the 8th and 9th selection score is small next to the score spread."""
    import torch

    from rollout.r3.replay import moe_gates

    gaps, spreads, cap = [], [], {}
    gates = moe_gates(model)
    hs = [g.register_forward_hook(lambda m, a, out, g=g: cap.__setitem__(g, out[0])) for g in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([list(range(3, 300, 5))]))
    finally:
        for h in hs:
            h.remove()
    for g in gates:
        s = (torch.sigmoid(cap[g]) + g.e_score_correction_bias).sort(dim=-1, descending=True).values
        gaps.append(float((s[:, 7] - s[:, 8]).median()))
        spreads.append(float((s[:, 0] - s[:, -1]).median()))
    assert max(g / s for g, s in zip(gaps, spreads)) < 0.05, (gaps, spreads)


def test_a_routing_flip_moves_the_logprobs(model):
    """Replaying the router's own choice changes nothing; swapping one expert of one layer on the
    response rows moves the response logprobs (experts matter)."""
    from rollout.r3.replay import recompute

    prompt, response = list(range(10, 40, 3)), list(range(50, 90, 4))
    own = recompute(model, prompt, response)
    same = recompute(model, prompt, response, own.routing)
    assert np.array_equal(same.logprobs, own.logprobs)
    rows = own.routing.copy()
    p = len(prompt) - 1
    for r in range(p, rows.shape[0]):  # layer 0: replace the last chosen expert by one not chosen
        rows[r, 0, -1] = next(e for e in range(64) if e not in rows[r, 0])
    moved = recompute(model, prompt, response, rows)
    assert np.abs(moved.logprobs - own.logprobs).mean() > 0.05
