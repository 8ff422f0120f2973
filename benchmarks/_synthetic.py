"""Synthetic SGLang-shaped routing for the benchmarks and the tests (not real engine output)."""
import numpy as np

from rollout.routed_experts.layout import MoELayout


def synthetic_full(rows: int, layout: MoELayout, seed: int = 0) -> np.ndarray:
    """int32 ``[rows, num_hidden_layers, topk]`` as SGLang returns it: distinct random ids per
    (token, MoE layer), dense layers all zeros."""
    rng = np.random.default_rng(seed)
    full = np.zeros((rows, layout.num_hidden_layers, layout.topk), np.int32)
    moe = list(layout.moe_layers)
    for r0 in range(0, rows, 1024):
        r1 = min(rows, r0 + 1024)
        keys = rng.random((r1 - r0, len(moe), layout.num_experts), dtype=np.float32)
        full[r0:r1, moe] = np.argpartition(keys, layout.topk - 1, axis=-1)[..., : layout.topk]
    return full
