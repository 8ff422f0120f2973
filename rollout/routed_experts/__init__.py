"""Routed experts (R3): decode SGLang's payload, validate it, keep it compact, feed megatron-core.

Layouts are documented in ``codec``. Entry points for the rollout manager and the slime adapter:

- ``MoELayout.from_hf_config(cfg)`` / ``from_first_k_dense`` / ``from_layer_freq``: describe the model.
- ``sample_routed_experts(meta_info, num_tokens, layout, held=None, start_len=None)``
  -> ``(compact, None)`` or ``(None, reason)``: decode + validate + compact + merge; never raises.
- ``decode_compact(payload, layout, num_tokens, start_len=0)``: same, raising ``RoutedExpertsError``.
- ``merge_segments(held, new, start_len)``: partial-rollout join of compact arrays.
- ``for_trainer(compact, layout, compact_path)``: compact tensor, or slime's int32 all-layer tensor.
- ``pack_replay_indices(samples, layout, ...)`` / ``load_replay(...)``: per-MoE-layer ``[N, topk]``
  tensors for megatron-core's ``RouterReplay.set_replay_data``; padding rows spread over EP ranks.
- ``slime_replay_padding.install``: the same padding for slime's own trainer
  (``--custom-megatron-init-path rollout.routed_experts.slime_replay_padding.install``).
"""
from .codec import decode_int32, encode_sglang, expand
from .errors import RoutedExpertsError
from .layout import MoELayout
from .megatron_replay import load_replay, pack_replay_indices
from .merge import merge_segments, sample_routed_experts
from .slime_shape import bytes_per_token, for_trainer, to_slime_shape
from .validate import decode_compact, try_decode_compact

__all__ = [
    "MoELayout", "RoutedExpertsError", "bytes_per_token", "decode_compact", "decode_int32", "encode_sglang",
    "expand", "for_trainer", "load_replay", "merge_segments", "pack_replay_indices",
    "sample_routed_experts", "to_slime_shape", "try_decode_compact",
]
