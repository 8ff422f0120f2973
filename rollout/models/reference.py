"""transformers' answers for the local checkpoints (the reference the engine's routed experts and greedy tokens
are checked against): the model (fp32, cached per path), its router's top-k per MoE layer, greedy generation.
Needs transformers (in every SGLang environment)."""
_HF = {}


def hf_model(path):
    """The checkpoint in transformers (fp32), cached per path."""
    if path not in _HF:
        import logging

        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_router_topk(path, token_ids) -> dict:
    """{moe_layer: [sorted expert ids per token]} from transformers' router on `token_ids`."""
    import torch

    m = hf_model(path)
    cap, handles = {}, []
    for i, layer in enumerate(m.model.layers):
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(lambda mod, a, out, i=i: cap.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            m(torch.tensor([list(token_ids)]))
    finally:
        for h in handles:
            h.remove()
    return {i: [sorted(r) for r in t.tolist()] for i, t in cap.items()}


def hf_greedy(path, token_ids, n) -> list:
    import torch

    m = hf_model(path)
    with torch.no_grad():
        out = m.generate(torch.tensor([list(token_ids)]), max_new_tokens=n, do_sample=False)
    return out[0, len(token_ids):].tolist()


