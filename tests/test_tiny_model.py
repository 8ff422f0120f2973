"""The tiny GLM-4.5 checkpoint: shape, determinism, and the properties the engine tests rely on."""
import hashlib
import json
import os

import pytest
from rollout.models.reference import hf_greedy, hf_model, hf_router_topk

from rollout.models.tiny import NUM_LAYERS, build_info, build_tiny_glm, expected_experts


def _digest(path):
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_config_is_glm45_shaped(tiny_model):
    cfg = json.load(open(os.path.join(tiny_model, "config.json")))
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] >= 16
    assert cfg["num_experts_per_tok"] >= 2 and cfg["n_shared_experts"] == 1
    assert cfg["num_nextn_predict_layers"] == 1
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_model, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().sum() > 0
    mtp = f"model.layers.{NUM_LAYERS}."
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "mlp.gate.weight", "mlp.experts.15.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert mtp + name in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.0.mlp.gate.weight" not in keys


def test_build_is_deterministic_and_idempotent(tmp_path, tiny_model):
    p = build_tiny_glm(str(tmp_path / "m"), variant="random", seed=0)
    assert _digest(p) == _digest(tiny_model)
    mtime = os.path.getmtime(os.path.join(p, "model.safetensors"))
    assert build_tiny_glm(p, variant="random", seed=0) == p
    assert os.path.getmtime(os.path.join(p, "model.safetensors")) == mtime
    q = build_tiny_glm(p, variant="random", seed=1)  # another config hash: rebuilt in place
    assert _digest(q) != _digest(tiny_model)


def test_unknown_variant_is_one_line_error():
    with pytest.raises(ValueError, match="unknown tiny-model variant"):
        build_tiny_glm("/tmp/unused", variant="nope")


def test_transformers_loads_every_weight(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith(f"model.layers.{NUM_LAYERS}.") for k in info["unexpected_keys"])  # the MTP layer


def test_router_topk_is_by_construction_with_margin(tiny_model):
    import torch

    ids = list(range(3, 320, 7))
    hf = hf_router_topk(tiny_model, ids)
    for layer in range(1, NUM_LAYERS):
        assert hf[layer] == expected_experts(ids, layer)
    # Margin: the k-th and (k+1)-th selection scores are far apart for every token.
    m = hf_model(tiny_model)
    cap = {}
    gates = [m.model.layers[i].mlp.gate for i in range(1, NUM_LAYERS)]
    hs = [g.register_forward_hook(lambda mod, a, out, g=g: cap.__setitem__(g, out[0])) for g in gates]
    try:
        with torch.no_grad():
            m(torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    for g in gates:
        scores = torch.sigmoid(cap[g]) + g.e_score_correction_bias
        top = scores.topk(5, dim=-1).values
        assert float((top[:, 3] - top[:, 4]).min()) > 0.2


def test_always_match_is_a_bigram(tiny_match_model):
    nxt = build_info(tiny_match_model)["next_token"]
    ids = [40, 41, 100, 7]
    out = hf_greedy(tiny_match_model, ids, 10)
    want, t = [], ids[-1]
    for _ in range(10):
        t = nxt[t]
        want.append(t)
    assert out == want


def test_config_builders_are_the_schema_choices(tmp_path):
    """`model.build` names exactly the builders `rollout.models` has; another name is a one-line error."""
    import typing

    from rollout import models
    from training_configs.schema import ModelConfig

    (choices,) = [a for a in typing.get_args(ModelConfig.model_fields["build"].annotation) if a is not type(None)]
    assert set(typing.get_args(choices)) == set(models.BUILDERS)
    with pytest.raises(ValueError, match="unknown model builder 'gpt2' \\(choose from tiny-glm45, near-tie-glm45\\)"):
        models.build("gpt2", str(tmp_path))
