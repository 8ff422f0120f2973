"""Packed microbatch -> the per-MoE-layer tensors megatron-core's router replay takes.

megatron-core 0.16.1: ``RouterReplay.set_replay_data(all_layers_topk_indices)`` wants one tensor
``[num_tokens, topk]`` per router instance, in the order the routers were built (one per local MoE
layer; each ``TopKRouter`` registers itself when ``TransformerConfig.moe_enable_routing_replay``).
In ``RouterReplayAction.REPLAY_FORWARD`` the router uses them as its top-k and gathers the probs.

Packing follows slime's layout (thd, one sequence after another): a sample of T tokens has
T-1 routing rows and one padding row for its last token; ``pad_to_multiple`` appends more padding
rows so the total matches a padded packed sequence. Padding rows get routes spread over experts
and ``ep_size`` ranks (``replay_padding``), not slime's fixed block that overloads one EP rank.
CP / sequence-parallel slicing is not done here (the same row slicing as for tokens applies).

MTP layers (``mtp_num_layers``): each MTP layer's ``TopKRouter`` registers a ``RouterReplay`` too, after
the decoder's (megatron-core 0.16.1 builds ``GPTModel.mtp`` after ``decoder``), but SGLang captures the
target model's layers only, so there is no captured route for it: ``set_replay_data`` with one tensor
per MoE layer raises its count error, and an MTP router in ``REPLAY_FORWARD`` has no target.
``load_replay(..., model=)`` takes the MTP routers out of replay first (``exclude_mtp_routers``): they
route on their own, as NeMo-RL does; the decoder routers get the captured rows.
"""
from typing import Optional, Sequence

import numpy as np

from rollout.errors import RoutedExpertsError
from .layout import MoELayout
from .replay_padding import PAD, fill_pad_rows, pad_row_mask


def pack_replay_indices(samples: Sequence, layout: MoELayout, token_lengths: Optional[Sequence[int]] = None,
                        pad_to_multiple: int = 1, local_moe_layers: Optional[Sequence[int]] = None,
                        dtype=None, ep_size: int = 1) -> list:
    """Per-sample routing (compact ``[T-1, num_moe_layers, topk]``, or slime's
    ``[T-1, num_hidden_layers, topk]``) -> list over local MoE layers of ``[N, topk]`` tensors.

    ``local_moe_layers``: indices into ``layout.moe_layers`` owned by this pipeline stage (default all).
    ``token_lengths``: len(tokens) per sample, checked against the rows (T-1 each).
    ``dtype``: of the returned tensors, default ``torch.int64`` (what ``torch.topk`` gives the router).
    ``ep_size``: the trainer's expert-parallel size, so padding rows spread evenly over its ranks.
    A sample row with a negative id (no captured route, or a partially padded one) is refused.
    """
    import torch
    dtype = torch.int64 if dtype is None else dtype
    local = list(range(layout.num_moe_layers) if local_moe_layers is None else local_moe_layers)
    arrays = [_moe_columns(np.asarray(s), layout, i) for i, s in enumerate(samples)]
    if token_lengths is not None:
        if len(token_lengths) != len(arrays):
            raise RoutedExpertsError(f"{len(arrays)} routing arrays for {len(token_lengths)} samples")
        for i, (a, t) in enumerate(zip(arrays, token_lengths)):
            if a.shape[0] != t - 1:
                raise RoutedExpertsError(f"sample {i}: {a.shape[0]} routing rows for {t} tokens, expected {t - 1}")
    n = sum(a.shape[0] + 1 for a in arrays)
    n_total = -(-n // pad_to_multiple) * pad_to_multiple
    out = np.full((n_total, len(local), layout.topk), PAD, dtype=np.int64)
    off = 0
    for a in arrays:
        out[off:off + a.shape[0]] = a[:, local]
        off += a.shape[0] + 1  # the row after each sample stays a padding row
    fill_pad_rows(out, layout.num_experts, ep_size, [layout.moe_layers[j] for j in local])
    return [torch.from_numpy(np.ascontiguousarray(out[:, j])).to(dtype) for j in range(len(local))]


def mtp_routers(model) -> list:
    """The ``TopKRouter``s inside megatron's MTP layers of ``model`` (a module or a list of model chunks)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [r for chunk in chunks for layer in chunk.modules() if isinstance(layer, MultiTokenPredictionLayer)
            for r in layer.modules() if isinstance(r, TopKRouter)]


def exclude_mtp_routers(model) -> int:
    """Take ``model``'s MTP routers out of router replay (they route on their own). Returns how many."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    instances = RouterReplay.global_router_replay_instances
    n = 0
    for r in mtp_routers(model):
        if r.router_replay is not None:
            instances[:] = [i for i in instances if i is not r.router_replay]
            r.router_replay = None
            n += 1
    return n


def load_replay(samples: Sequence, layout: MoELayout, model=None, **kwargs) -> list:
    """``pack_replay_indices`` then ``RouterReplay.set_replay_data`` (megatron-core imported here).

    ``model``: the trainer's model (chunks); with MTP layers it is needed (``exclude_mtp_routers``).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay
    if model is not None:
        exclude_mtp_routers(model)
    per_layer = pack_replay_indices(samples, layout, **kwargs)
    replaying = len(RouterReplay.global_router_replay_instances)
    if len(per_layer) != replaying:
        raise RoutedExpertsError(
            f"routing for {len(per_layer)} MoE layers, but {replaying} routers replay"
            + ("" if model is not None else " (MTP layers? pass model= so that MTP routers route on their own)"))
    RouterReplay.set_replay_data(per_layer)
    return per_layer


def _moe_columns(a: np.ndarray, layout: MoELayout, i: int) -> np.ndarray:
    if a.ndim != 3 or a.shape[2] != layout.topk:
        raise RoutedExpertsError(f"sample {i}: routing shape {a.shape} is not [rows, layers, topk={layout.topk}]")
    if a.shape[1] == layout.num_hidden_layers and a.shape[1] != layout.num_moe_layers:
        a = a[:, list(layout.moe_layers)]
    elif a.shape[1] != layout.num_moe_layers:
        raise RoutedExpertsError(
            f"sample {i}: {a.shape[1]} layers, expected {layout.num_moe_layers} (compact) or {layout.num_hidden_layers}")
    if np.issubdtype(a.dtype, np.signedinteger) and pad_row_mask(a, f"sample {i}: ").any():
        row, col = (int(x[0]) for x in np.nonzero(pad_row_mask(a)))
        raise RoutedExpertsError(f"sample {i}: row {row} MoE layer {col} has no captured route (all {PAD})")
    return a
