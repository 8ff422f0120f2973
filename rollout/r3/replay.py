"""Trainer-side recompute with transformers' GLM-4.5 forward: own routing, or captured routing replayed.

Replay rule (megatron-core ``RouterReplay``, slime, Miles): keep the replayed expert ids, gather the
router's own unbiased (sigmoid) scores at them, normalise (``norm_topk_prob``, +1e-20 as the router
does) and scale (``routed_scaling_factor``). The seam is the installed transformers version's own:

- 5.x (``Glm4MoeTopkRouter.forward`` returns ``(router_logits, weights, indices)``): a forward hook on
  each ``mlp.gate`` replaces weights and indices in that output, the router itself runs unchanged.

Any other seam is refused with one line (no copied function body stands in for it).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np


class ReplaySeamError(RuntimeError):
    pass


@dataclass
class Recompute:
    logprobs: np.ndarray     # [R] logprob of each response token under the trainer forward
    routing: np.ndarray      # [T-1, num_moe_layers, topk] expert ids the forward used (row i = token i)


def load_model(path: str, dtype: str = "bfloat16"):
    """The checkpoint in transformers (eval mode, `dtype`), quiet."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def moe_gates(model) -> list:
    """The routers of the MoE layers, in model order (dense layers have none)."""
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if not gates:
        raise ReplaySeamError("the model has no MoE router (`mlp.gate`) to replay")
    return gates


def replay_weights(router_logits, indices, norm_topk_prob: bool, scaling: float):
    """The replay rule: unbiased sigmoid scores gathered at `indices`, normalised, scaled."""
    w = router_logits.float().sigmoid().gather(1, indices.long())
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling


@contextmanager
def routing_seam(model, replay: Optional[list] = None, record: Optional[list] = None):
    """Within the block, each MoE router's indices are taken from `replay[j]` (a ``[N, topk]`` int tensor
    per MoE layer, N rows of the flattened batch; rows beyond it keep the router's own choice) and the
    indices used are appended to `record[j]`."""
    import torch

    gates = moe_gates(model)
    handles = []

    def hook(j, gate):
        def fn(mod, args, out):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise ReplaySeamError(
                    f"{type(mod).__name__}.forward returns {type(out).__name__}, not (logits, weights, indices): "
                    "this transformers version has a routing seam the replay does not know")
            logits, weights, indices = out
            if replay is not None:
                fixed = replay[j].to(indices.device, indices.dtype)
                n = min(fixed.shape[0], indices.shape[0])
                indices = torch.cat([fixed[:n], indices[n:]])
                weights = replay_weights(logits, indices, mod.norm_topk_prob, mod.routed_scaling_factor)
                weights = weights.to(out[1].dtype)
            if record is not None:
                record[j].append(indices.detach().cpu())
            return logits, weights, indices
        return fn

    try:
        for j, gate in enumerate(gates):
            handles.append(gate.register_forward_hook(hook(j, gate)))
        yield gates
    finally:
        for h in handles:
            h.remove()


def recompute(model, prompt_ids, response_ids, replay_rows: Optional[np.ndarray] = None) -> Recompute:
    """Logprobs of `response_ids` after `prompt_ids` in one forward (batch 1), with the trainer's own
    routing or, given `replay_rows` (compact ``[T-1, num_moe_layers, topk]``), the captured one."""
    import torch

    tokens = list(prompt_ids) + list(response_ids)
    n_moe = len(moe_gates(model))
    replay = None
    if replay_rows is not None:
        rows = np.asarray(replay_rows)
        if rows.ndim != 3 or rows.shape[1] != n_moe:
            raise ReplaySeamError(f"replay rows shaped {rows.shape}, expected [T-1, {n_moe}, topk]")
        replay = [torch.from_numpy(rows[:, j].astype(np.int64)) for j in range(n_moe)]
    record = [[] for _ in range(n_moe)]
    with torch.no_grad(), routing_seam(model, replay=replay, record=record):
        logits = model(torch.tensor([tokens])).logits[0].float()
    p = len(prompt_ids)
    lp = torch.log_softmax(logits[p - 1:len(tokens) - 1], dim=-1)
    out = lp.gather(1, torch.tensor(response_ids).view(-1, 1))[:, 0].numpy()
    used = np.stack([torch.cat(r).numpy() for r in record], axis=1)[: len(tokens) - 1]
    return Recompute(out.astype(np.float64), used)
