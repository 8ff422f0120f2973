"""A near-tie tiny GLM-4.5 MoE (`Glm4MoeForCausalLM`), built locally, no hub: routers that sit near ties.

The routers of trained MoE models sit near ties, so two engines whose bf16 arithmetic differs in the
last bits pick different experts for a few percent of tokens; that is what routing replay (R3) fixes.
This model reproduces it at tiny size (the large-margin model in `tiny` does the opposite):

- bf16 weights, 5 decoder layers (layer 0 dense, layers 1-4 MoE) and one NextN/MTP layer (layer 5),
  64 routed experts, top-8, 4 groups keep 2 (`n_group`/`topk_group`), sigmoid router with
  correction bias, one shared expert, routed_scaling_factor 2.5.
- BASE (dims 0-15): every embedding holds a constant BASE_VALUE there and every sublayer adds to it.
  Where the residual is rounded to bf16 differs between engines (SGLang normalises the fp32 sum,
  transformers the bf16 one), so these large elements differ by up to half a bf16 step. Router rows
  read BASE with weights of zero mean (the constant cancels between experts) and the rest only
  weakly: the rounding difference is a sizeable part of the top-k gaps, so sets flip near ties.
- Nothing but the routers reads BASE (attention, experts and lm_head weights are zero there), so
  with the routing replayed the two engines differ by rounding only, and without it a flipped
  expert (large outputs, scaled 2.5) moves the logits.
"""
import hashlib
import json
import os

from rollout.models import tiny
from rollout.models.tiny import EOS, SPECIALS, VOCAB, build_atomic, build_tokenizer, write_checkpoint

BUILDER_VERSION = 1
STAMP = "tiny_glm_build.json"
HIDDEN = 128
BASE = slice(0, 16)
BASE_VALUE = 2.0
N_EXPERTS = 64
TOP_K = 8
N_GROUP = 4
TOPK_GROUP = 2
NUM_LAYERS = 5  # layer 0 dense, 1-4 MoE; the MTP layer is stored as layer NUM_LAYERS
MOE_INTER = 16
ROUTER_BASE_STD = 0.1   # router weights on BASE (zero mean per row)
ROUTER_REST_STD = 0.02  # router weights on the other dims
EXPERT_OUT_GAIN = 2.0
HEAD_STD = 2.0          # lm_head weights (times hidden ** -0.5): peaked enough that a flip moves logprobs


def default_path() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    return os.path.join(root, ".cache", "tiny-glm45-near-tie")


def model_config(eos_id: int) -> dict:
    return tiny.model_config(
        eos_id, hidden_size=HIDDEN, moe_intermediate_size=MOE_INTER, num_hidden_layers=NUM_LAYERS, head_dim=32,
        n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP,
        routed_scaling_factor=2.5)


def config_hash(seed: int) -> str:
    knobs = [BASE_VALUE, ROUTER_BASE_STD, ROUTER_REST_STD, EXPERT_OUT_GAIN, HEAD_STD, BASE.start, BASE.stop]
    blob = json.dumps({"v": BUILDER_VERSION, "seed": seed, "cfg": model_config(0), "knobs": knobs,
                       "specials": SPECIALS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_built(path: str, seed: int = 0) -> bool:
    try:
        with open(os.path.join(path, STAMP)) as f:
            return json.load(f).get("hash") == config_hash(seed)
    except (OSError, ValueError):
        return False


def build_near_tie_glm(path: str | None = None, seed: int = 0) -> str:
    """Write the checkpoint to `path` (idempotent: skipped when built with the same config)."""
    path = os.path.abspath(path or default_path())
    return build_atomic(path, lambda p: is_built(p, seed), lambda d: _write(d, seed))


def _write(out_dir: str, seed: int) -> None:
    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS)
    stamp = {"hash": config_hash(seed), "variant": "near-tie", "seed": seed}
    write_checkpoint(out_dir, tok, model_config(eos_id), _tensors(seed), stamp)


def _tensors(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed + 23)
    H, V = HIDDEN, VOCAB
    reads = torch.ones(H, dtype=torch.bool)
    reads[BASE] = False  # only the routers read BASE

    def rnd(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * std

    def inp(n_out):  # a projection out of the residual stream: never reads BASE
        w = rnd(n_out, H, std=(H - (BASE.stop - BASE.start)) ** -0.5)
        w[:, ~reads] = 0.0
        return w

    def norm_w():
        w = 1.0 + 0.1 * torch.randn(H, generator=g)
        w[BASE] = 1.0
        return w

    emb = rnd(V, H, std=1.0)
    emb[:, BASE] = BASE_VALUE
    head = rnd(V, H, std=HEAD_STD * H ** -0.5)
    head[:, BASE] = 0.0
    t = {"model.embed_tokens.weight": emb, "model.norm.weight": norm_w(), "lm_head.weight": head}

    def attn(p):
        t[p + "input_layernorm.weight"] = norm_w()
        t[p + "post_attention_layernorm.weight"] = norm_w()
        t[p + "self_attn.q_proj.weight"] = inp(128)
        t[p + "self_attn.q_proj.bias"] = rnd(128, std=0.1)
        for n in ("k", "v"):
            t[p + f"self_attn.{n}_proj.weight"] = inp(64)
            t[p + f"self_attn.{n}_proj.bias"] = rnd(64, std=0.1)
        t[p + "self_attn.o_proj.weight"] = rnd(H, 128)

    def mlp(p, inter, gain=1.0):
        t[p + "gate_proj.weight"] = inp(inter)
        t[p + "up_proj.weight"] = inp(inter)
        t[p + "down_proj.weight"] = rnd(H, inter) * gain

    def moe(p):
        gate = rnd(N_EXPERTS, H, std=ROUTER_REST_STD)
        b = rnd(N_EXPERTS, BASE.stop - BASE.start, std=ROUTER_BASE_STD)
        gate[:, BASE] = b - b.mean(dim=1, keepdim=True)  # the constant BASE_VALUE cancels between experts
        t[p + "mlp.gate.weight"] = gate
        t[p + "mlp.gate.e_score_correction_bias"] = rnd(N_EXPERTS, std=0.01)
        for e in range(N_EXPERTS):
            mlp(p + f"mlp.experts.{e}.", MOE_INTER, EXPERT_OUT_GAIN)
        mlp(p + "mlp.shared_experts.", MOE_INTER)

    for layer in range(NUM_LAYERS + 1):
        p = f"model.layers.{layer}."
        attn(p)
        if layer == 0:
            mlp(p + "mlp.", 128)
        else:
            moe(p)
    p = f"model.layers.{NUM_LAYERS}."
    t[p + "enorm.weight"] = norm_w()
    t[p + "hnorm.weight"] = norm_w()
    t[p + "shared_head.norm.weight"] = norm_w()
    t[p + "eh_proj.weight"] = rnd(H, 2 * H)
    return {k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous()
            for k, v in t.items()}
