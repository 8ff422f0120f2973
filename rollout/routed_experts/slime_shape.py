"""What slime's trainer holds today, so the compact path can be switched on or off.

slime keeps ``sample.rollout_routed_experts`` as int32 ``[len(tokens)-1, num_layers, topk]``
(every layer, dense ones as zeros) and builds ``train_data["rollout_routed_experts"]`` from it.
"""
import numpy as np

from .codec import expand
from .layout import MoELayout


def to_slime_shape(compact_arr: np.ndarray, layout: MoELayout):
    """Compact ``[rows, num_moe_layers, topk]`` -> int32 tensor ``[rows, num_hidden_layers, topk]``."""
    import torch
    return torch.from_numpy(expand(compact_arr, layout))


def for_trainer(compact_arr: np.ndarray, layout: MoELayout, compact_path: bool):
    """The ``rollout_routed_experts`` value to hand slime: compact (uint8/int16, MoE layers only)
    when ``compact_path`` is on, else exactly slime's int32 all-layer shape."""
    import torch
    if compact_path:
        return torch.from_numpy(np.ascontiguousarray(compact_arr))
    return to_slime_shape(compact_arr, layout)


def bytes_per_token(layout: MoELayout, compact_path: bool) -> int:
    """Bytes held per token for the trainer on each path (GLM-4.5: 712 vs 2944)."""
    if compact_path:
        return layout.num_moe_layers * layout.topk * layout.compact_dtype.itemsize
    return layout.num_hidden_layers * layout.topk * 4
