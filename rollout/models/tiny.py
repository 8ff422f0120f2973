"""A tiny, deterministic GLM-4.5 MoE checkpoint (`Glm4MoeForCausalLM`) built locally, no hub.

Shape: 3 decoder layers (layer 0 dense, layers 1-2 MoE with 16 routed experts, top-4, one
shared expert, sigmoid router with correction bias) plus one MTP/NextN layer stored the way
GLM-4.5 stores it (`model.layers.3.*` with `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`).
Experts are written per expert (`mlp.experts.<i>.gate_proj.weight`), which SGLang loads
directly and transformers converts to its fused layout on load.

The hidden state (size 96) is split into three blocks that the builder controls:
- CODE (dims 0-15): each token's embedding carries an explicit expert code, no sublayer
  writes there, and every router reads only these dims (through a per-layer permutation).
  The top-k margin is therefore large: SGLang (bf16 logits) and transformers (fp32 logits)
  pick the same expert set for every token.
- IDENT (dims 16-63): a unit vector per token. In the "always-match" variant no sublayer
  writes there either and `lm_head` maps token t's vector to token `next_token(t)`, so the
  model is a bigram (greedy output is predictable) and the MTP layer, which copies the
  embedding half through `eh_proj`, predicts the same token: drafts always match.
- FREE (dims 64-95): attention and MLP outputs. In the "random" variant sublayers write to
  IDENT and FREE and `lm_head` / `eh_proj` are random.
"""
import hashlib
import json
import os
import shutil
import tempfile

VARIANTS = ("random", "always-match")
BUILDER_VERSION = 2
STAMP = "tiny_glm_build.json"

HIDDEN = 96
CODE = slice(0, 16)
IDENT = slice(16, 64)
FREE = slice(64, 96)
N_EXPERTS = 16
TOP_K = 4
NUM_LAYERS = 3  # layer 0 dense; the MTP layer is stored as layer NUM_LAYERS
VOCAB = 320  # a multiple of 64 * attn_tp: SGLang pads lm_head shards to 64 (see _gather_attn_tp_logits)
EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|user|>", "<|assistant|>"]
# Router inputs: chosen experts get these code values (distinct: the order is defined too).
CHOSEN_CODE = (3.0, 2.5, 2.0, 1.5)
UNCHOSEN_CODE = -1.5

TRAIN_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a mixture of experts routes every token to a few experts",
    "speculative decoding drafts tokens and the target model verifies them",
    "data parallel attention splits the batch across ranks",
    "rollout routing replay records which experts each token used",
    "reinforcement learning samples many responses for every prompt",
    "the rollout manager streams finished groups to the trainer",
    "tiny models make tests fast on two cpu cores",
    "hello world, this is a tiny glm model with one mtp layer",
    "numbers like 0 1 2 3 4 5 6 7 8 9 and punctuation: ; ! ? ( ) -",
]


def default_path(variant: str = "random") -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
    name = "tiny-glm45" if variant == "random" else "tiny-glm45-match"
    return os.path.join(root, ".cache", name)


def model_config(eos_id: int, **sizes) -> dict:
    """The GLM-4.5 MoE config.json of the tiny models; `sizes` overrides keys (the near-tie model's)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "tie_word_embeddings": False,
        "n_routed_experts": N_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 1,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    } | sizes


def config_hash(variant: str, seed: int) -> str:
    blob = json.dumps({"v": BUILDER_VERSION, "variant": variant, "seed": seed, "cfg": model_config(0),
                       "text": TRAIN_TEXT, "specials": SPECIALS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_built(path: str, variant: str = "random", seed: int = 0) -> bool:
    try:
        with open(os.path.join(path, STAMP)) as f:
            return json.load(f).get("hash") == config_hash(variant, seed)
    except (OSError, ValueError):
        return False


def build_tiny_glm(path: str | None = None, variant: str = "random", seed: int = 0) -> str:
    """Write the checkpoint to `path` (idempotent: skipped when built with the same config)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny-model variant {variant!r} (choose from {', '.join(VARIANTS)})")
    path = os.path.abspath(path or default_path(variant))
    return build_atomic(path, lambda p: is_built(p, variant, seed), lambda d: _write(d, variant, seed))


def build_atomic(path: str, built, write) -> str:
    """Run `write(tmp_dir)` and rename the result to `path`; skipped when `built(path)` (a finished
    build with the same config hash). Concurrent builders are safe: the first rename wins."""
    if built(path):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-glm-", dir=parent)
    try:
        write(tmp)
        if os.path.exists(path):
            if built(path):  # a concurrent builder won
                return path
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    return tok


def next_token_map(seed: int, special_ids) -> list:
    """The bigram of the always-match variant: a permutation of the regular token ids."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    regular = [i for i in range(VOCAB) if i not in set(special_ids)]
    perm = torch.randperm(len(regular), generator=g).tolist()
    nxt = list(range(VOCAB))
    for i, t in enumerate(regular):
        nxt[t] = regular[perm[i]]
    return nxt


def expert_sets(seed: int):
    """(codes [VOCAB, 16], perms [layers+1, 16]): token code and each MoE router's permutation."""
    import torch

    g = torch.Generator().manual_seed(seed + 11)
    codes = torch.full((VOCAB, N_EXPERTS), UNCHOSEN_CODE)
    for t in range(VOCAB):
        chosen = torch.randperm(N_EXPERTS, generator=g)[:TOP_K]
        codes[t, chosen] = torch.tensor(CHOSEN_CODE)
    perms = torch.stack([torch.randperm(N_EXPERTS, generator=g) for _ in range(NUM_LAYERS + 1)])
    return codes, perms


def expected_experts(token_ids, layer: int, seed: int = 0) -> list:
    """The expert set (sorted) the router of MoE `layer` picks for each token, by construction."""
    codes, perms = expert_sets(seed)
    out = []
    for t in token_ids:
        dims = set(codes[t].topk(TOP_K).indices.tolist())
        out.append(sorted(e for e in range(N_EXPERTS) if int(perms[layer][e]) in dims))
    return out


def _tensors(variant: str, seed: int, eos_id: int, special_ids) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    H, V = HIDDEN, VOCAB
    match = variant == "always-match"
    # Dims a sublayer may write: FREE only (always-match) or IDENT+FREE (random).
    writable = torch.zeros(H, dtype=torch.bool)
    writable[FREE] = True
    if not match:
        writable[IDENT] = True

    def rnd(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * std

    def norm_w():
        w = 1.0 + 0.1 * torch.randn(H, generator=g)
        w[CODE] = 1.0
        if match:
            w[IDENT] = 1.0
        return w

    def out_proj(n_in):  # a projection into the residual stream: only writable rows
        w = rnd(H, n_in)
        w[~writable] = 0.0
        return w

    codes, perms = expert_sets(seed)
    ident = rnd(V, IDENT.stop - IDENT.start, std=1.0)
    ident = ident / ident.norm(dim=-1, keepdim=True) * (IDENT.stop - IDENT.start) ** 0.5
    emb = torch.zeros(V, H)
    emb[:, CODE] = codes
    emb[:, IDENT] = ident
    emb[:, FREE] = rnd(V, FREE.stop - FREE.start, std=1.0)

    t = {"model.embed_tokens.weight": emb, "model.norm.weight": norm_w()}
    if match:
        nxt = next_token_map(seed, special_ids)
        head = torch.zeros(V, H)
        for tok in range(V):
            if tok not in special_ids:
                head[nxt[tok], IDENT] = ident[tok] * (8.0 / (IDENT.stop - IDENT.start) ** 0.5)
        t["lm_head.weight"] = head
    else:
        t["lm_head.weight"] = rnd(V, H)

    def attn(p):
        t[p + "input_layernorm.weight"] = norm_w()
        t[p + "post_attention_layernorm.weight"] = norm_w()
        t[p + "self_attn.q_proj.weight"] = rnd(64, H)
        t[p + "self_attn.q_proj.bias"] = rnd(64, std=0.1)
        for n in ("k", "v"):
            t[p + f"self_attn.{n}_proj.weight"] = rnd(32, H)
            t[p + f"self_attn.{n}_proj.bias"] = rnd(32, std=0.1)
        t[p + "self_attn.o_proj.weight"] = out_proj(64)

    def mlp(p, inter):
        t[p + "gate_proj.weight"] = rnd(inter, H)
        t[p + "up_proj.weight"] = rnd(inter, H)
        t[p + "down_proj.weight"] = out_proj(inter)

    def moe(p, layer):
        gate = torch.zeros(N_EXPERTS, H)
        gate[torch.arange(N_EXPERTS), perms[layer]] = 1.0  # expert e reads code dim perms[layer][e]
        t[p + "mlp.gate.weight"] = gate
        t[p + "mlp.gate.e_score_correction_bias"] = rnd(N_EXPERTS, std=0.01)
        for e in range(N_EXPERTS):
            mlp(p + f"mlp.experts.{e}.", 32)
        mlp(p + "mlp.shared_experts.", 32)

    for layer in range(NUM_LAYERS + 1):
        p = f"model.layers.{layer}."
        attn(p)
        if layer == 0:
            mlp(p + "mlp.", 128)
        else:
            moe(p, layer)
    p = f"model.layers.{NUM_LAYERS}."
    t[p + "enorm.weight"] = norm_w()
    t[p + "hnorm.weight"] = norm_w()
    t[p + "shared_head.norm.weight"] = norm_w()
    eh = rnd(H, 2 * H)
    if match:  # copy the next token's CODE and IDENT through; ignore the target hidden there
        keep = torch.zeros(H, dtype=torch.bool)
        keep[CODE] = True
        keep[IDENT] = True
        eh[keep] = 0.0
        eh[keep, torch.arange(H)[keep]] = 1.0
    else:
        eh[CODE] = 0.0
        eh[CODE, torch.arange(H)[CODE]] = 1.0
    t[p + "eh_proj.weight"] = eh
    out = {}
    for k, v in t.items():
        out[k] = v.float().contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16).contiguous()
    return out


def _write(out_dir: str, variant: str, seed: int) -> None:
    tok = build_tokenizer()
    eos_id = tok.token_to_id(EOS)
    special_ids = [tok.token_to_id(s) for s in SPECIALS]
    stamp = {"hash": config_hash(variant, seed), "variant": variant, "seed": seed}
    if variant == "always-match":
        stamp["next_token"] = next_token_map(seed, special_ids)
    write_checkpoint(out_dir, tok, model_config(eos_id), _tensors(variant, seed, eos_id, special_ids), stamp)


def write_checkpoint(out_dir: str, tok, cfg: dict, tensors: dict, stamp: dict) -> None:
    """Tokenizer files, config.json, generation_config.json, model.safetensors and the build stamp."""
    from safetensors.torch import save_file

    eos_id = tok.token_to_id(EOS)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
               "model_max_length": 2048, "clean_up_tokenization_spaces": False}
    files = {
        "tokenizer_config.json": tok_cfg,
        "special_tokens_map.json": {"eos_token": EOS, "pad_token": EOS},
        "config.json": cfg,
        "generation_config.json": {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False},
    }
    for name, obj in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, STAMP), "w") as f:
        json.dump(stamp, f)


def build_info(path: str) -> dict:
    with open(os.path.join(path, STAMP)) as f:
        return json.load(f)
