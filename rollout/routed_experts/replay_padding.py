"""Routes for replay padding rows, spread over experts and expert-parallel ranks.

Padding rows (each sample's last token, CP and batch alignment) are loss-masked but still go
through MoE dispatch. slime fills them from ``arange(...) % num_experts`` restarted per call, so
every sample's pad row gets the same contiguous expert block in a layer: one or two EP ranks
take all of it (slime#2308, miles#2697; OOM at long context). Here pad row ``p`` (its ordinal
among the pad rows of one packed microbatch), layer ``l`` and top-k column ``c`` get a rank-first
permutation: ``a = p*K + c + l*P*K``, EP rank ``a % P``, local expert ``(a // P) % Q`` with
``Q = E / P``. Each row keeps K distinct experts (K <= E), and any run of pad rows differs by at
most one assignment between EP ranks.

A row with only some top-k slots -1 still carries a real route; megatron's replay has no per-slot
mask, so inventing experts for the -1 slots would change the policy: it is refused (miles#2770).
"""
import numpy as np

from rollout.errors import RoutedExpertsError

PAD = -1  # a whole row of it marks a padding row


def spread_pad_routes(num_rows: int, num_experts: int, topk: int, ep_size: int = 1, layer: int = 0) -> np.ndarray:
    """``[num_rows, topk]`` int64 routes for ``num_rows`` consecutive pad rows of one layer."""
    if ep_size <= 0 or num_experts % ep_size:
        raise RoutedExpertsError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    if not 0 < topk <= num_experts:
        raise RoutedExpertsError(f"topk={topk} must be in [1, num_experts={num_experts}]")
    per_rank = num_experts // ep_size
    a = np.arange(num_rows, dtype=np.int64)[:, None] * topk + np.arange(topk) + layer * ep_size * topk
    return (a % ep_size) * per_rank + (a // ep_size) % per_rank


def pad_row_mask(rows: np.ndarray, where: str = "") -> np.ndarray:
    """``rows[N, ..., K]`` -> bool ``[N, ...]``: True where all K slots are ``PAD``.
    Raises naming the first row where only some slots are ``PAD`` (or negative)."""
    neg = rows < 0
    full = neg.all(-1)
    partial = neg.any(-1) & ~full
    if partial.any():
        idx = tuple(int(i[0]) for i in np.nonzero(partial))
        raise RoutedExpertsError(
            f"{where}row {idx[0]}{' layer ' + str(idx[1]) if len(idx) > 1 else ''}: partially padded route "
            f"{rows[idx].tolist()} (some top-k slots {PAD}): replay cannot mask single slots, refusing it")
    if (rows[full] != PAD).any():
        raise RoutedExpertsError(f"{where}negative expert ids other than {PAD} in a padding row")
    return full


def fill_pad_rows(rows: np.ndarray, num_experts: int, ep_size: int = 1, layers=None) -> np.ndarray:
    """Fill the all-``PAD`` rows of ``rows[N, L, K]`` in place (ordinals counted per layer, in row
    order) and return it. ``layers``: the model layer index of each column (default 0..L-1)."""
    mask = pad_row_mask(rows)
    layers = range(rows.shape[1]) if layers is None else layers
    for j, layer in enumerate(layers):
        n = int(mask[:, j].sum())
        if n:
            rows[mask[:, j], j] = spread_pad_routes(n, num_experts, rows.shape[2], ep_size, layer)
    return rows


def load_per_rank(routes: np.ndarray, num_experts: int, ep_size: int) -> tuple:
    """``routes[..., K]`` -> (assignments per expert, per EP rank) as int arrays."""
    per_expert = np.bincount(np.asarray(routes).reshape(-1), minlength=num_experts)
    return per_expert, per_expert.reshape(ep_size, -1).sum(1)
