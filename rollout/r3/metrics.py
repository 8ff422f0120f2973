"""Rollout-vs-trainer mismatch metrics (AReaL's R3 table, slime's and Miles' names).

With d = logp_trainer - logp_rollout per response token (the SAME token, both sides):
k3 KL = mean(exp(d) - 1 - d), mean |d|, extreme fractions mean(|d| > ln 2) and mean(|d| > ln 5).
Routing flips compare expert SETS per token row and MoE layer (order within top-k is not routing).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

LN2, LN5 = math.log(2.0), math.log(5.0)


@dataclass
class Mismatch:
    tokens: int
    k3_kl: float
    mean_abs_diff: float
    extreme_frac_ln2: float
    extreme_frac_ln5: float
    flip_rate_per_layer: list     # per MoE layer: fraction of token rows whose expert set differs
    flip_rate: float              # over all token-layers
    tokens_any_flip: float        # fraction of token rows with a different set in at least one layer

    def as_dict(self) -> dict:
        return asdict(self)


def logprob_stats(trainer, rollout) -> dict:
    d = np.asarray(trainer, np.float64) - np.asarray(rollout, np.float64)
    if d.size == 0:
        raise ValueError("no response tokens to compare")
    a = np.abs(d)
    return {"tokens": int(d.size), "k3_kl": float(np.mean(np.expm1(d) - d)), "mean_abs_diff": float(a.mean()),
            "extreme_frac_ln2": float(np.mean(a > LN2)), "extreme_frac_ln5": float(np.mean(a > LN5))}


def set_flips(a, b) -> np.ndarray:
    """bool ``[rows, layers]``: the top-k expert sets of `a` and `b` (``[rows, layers, topk]``) differ."""
    a, b = np.sort(np.asarray(a), axis=-1), np.sort(np.asarray(b), axis=-1)
    if a.shape != b.shape:
        raise ValueError(f"routing shapes differ: {a.shape} vs {b.shape}")
    return (a != b).any(axis=-1)


def mismatch(trainer_lp: list, rollout_lp: list, trainer_routing: list, rollout_routing: list) -> Mismatch:
    """Per-sample lists (response logprobs; ``[T-1, moe_layers, topk]`` routing) -> one pooled table row."""
    lp = logprob_stats(np.concatenate([np.asarray(x, np.float64) for x in trainer_lp]),
                       np.concatenate([np.asarray(x, np.float64) for x in rollout_lp]))
    flips = np.concatenate([set_flips(t, r) for t, r in zip(trainer_routing, rollout_routing)], axis=0)
    return Mismatch(**lp, flip_rate_per_layer=[float(x) for x in flips.mean(axis=0)],
                    flip_rate=float(flips.mean()), tokens_any_flip=float(flips.any(axis=1).mean()))
