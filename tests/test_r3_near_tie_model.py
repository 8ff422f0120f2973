"""The near-tie tiny GLM-4.5: shape, determinism, and the two properties routing replay needs.

Its flip rate against a real SGLang engine is measured by `r3 check` (tests/test_r3_check_engine.py,
recorded in tests/facts/r3-near-tie-sglang-0.5.23.json and checked in tests/test_r3_mismatch.py).
"""
import hashlib
import json
import os

import numpy as np
import pytest

from rollout.models.near_tie import NUM_LAYERS, build_near_tie_glm, config_hash


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


HALF_BF16_STEP = 2.0 ** -7  # at BASE_VALUE 2.0: how far two engines' bf16 roundings of the residual differ
NEAR_TIE_FLIPS = 0.02       # the property: at least this share of tokens changes its top-k set


def _flip_share(model, seed=0) -> float:
    """Share of (token, MoE layer) whose top-k expert set changes when the router input's BASE dims move by
    half a bf16 step either way (the rounding difference between engines), over 632 tokens."""
    import torch

    from rollout.models.near_tie import BASE, TOP_K
    from rollout.r3.replay import moe_gates

    cap, gates = {}, moe_gates(model)
    hs = [g.register_forward_pre_hook(lambda m, a, g=g: cap.__setitem__(g, a[0].reshape(-1, a[0].shape[-1])))
          for g in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([list(range(3, 320)) + list(range(319, 3, -1))]))
    finally:
        for h in hs:
            h.remove()
    gen, flips = torch.Generator().manual_seed(seed), []
    for g in gates:
        h = cap[g].float()
        d = torch.zeros_like(h)
        d[:, BASE] = (torch.randint(0, 2, d[:, BASE].shape, generator=gen) * 2 - 1) * HALF_BF16_STEP

        def top(x):
            with torch.no_grad():
                scores = torch.sigmoid(torch.nn.functional.linear(x, g.weight.float())) + g.e_score_correction_bias
            return scores.topk(TOP_K, dim=-1).indices.sort(dim=-1).values

        flips.append(float((top(h) != top(h + d)).any(-1).float().mean()))
    return sum(flips) / len(flips)


def test_routers_sit_near_ties(model):
    """Half a bf16 step on the router input flips a few percent of top-k sets (trained routers' behaviour);
    the same routers with 20x larger weights off BASE (large top-k margins) must fail the same check."""
    import copy

    import torch

    from rollout.models.near_tie import BASE
    from rollout.r3.replay import moe_gates

    share = _flip_share(model)
    wide = copy.deepcopy(model)
    for g in moe_gates(wide):
        with torch.no_grad():
            w = g.weight.float()
            w[:, BASE.stop:] *= 20
            g.weight.copy_(w.to(g.weight.dtype))
    control = _flip_share(wide)
    print(f"top-k sets flipped by half a bf16 step: near-tie {share:.3f}, large-margin control {control:.3f}")
    assert share >= NEAR_TIE_FLIPS, share
    assert control < NEAR_TIE_FLIPS, control   # the check tells near ties from large margins


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
