"""Routed experts (R3): decode SGLang's payload, validate it, keep it compact, feed megatron-core.

Layouts are documented in ``codec``. The one entry point per SGLang answer (the dispatcher calls it,
for the rollout manager and the slime adapter alike):

- ``sample_routed_experts(meta_info, num_tokens, layout, held=None, start_len=None, sent_version=None)``
  -> ``(compact, None)`` or ``(None, reason)``: retraction check + decode + validate + compact + merge
  with the segment held; never raises. ``continuation_start(held, num_tokens)``: the start to send.

Its parts and the trainer side:

- ``MoELayout.from_hf_config(cfg)`` / ``from_model`` / ``from_first_k_dense`` / ``from_layer_freq``.
- ``decode_compact(payload, layout, num_tokens, start_len=0)``: decode + validate, raising ``RoutedExpertsError``.
- ``decode_wire`` / ``engine_offers`` / ``opt_in``: the compact format an engine with the plugin's
  ``compact-routed-experts`` feature sends to the requests that ask for it (``wire``).
- ``merge_segments(held, new, start_len)``: partial-rollout join of compact arrays, with its shape checks.
- ``for_trainer`` / ``to_slime_shape``: compact tensor, or slime's int32 all-layer tensor.
- ``pack_replay_indices(samples, layout, ...)`` / ``load_replay(...)``: per-MoE-layer ``[N, topk]``
  tensors for megatron-core's ``RouterReplay.set_replay_data``; padding rows spread over EP ranks.
- ``slime_replay_padding.install``: the same padding for slime's own trainer
  (``--custom-megatron-init-path rollout.routed_experts.slime_replay_padding.install``).
- ``slime_compact``: opt-in, slime keeps the compact arrays until replay (its own validation and
  replay preparation run on each sample expanded to its int32 shape).
"""
from rollout.errors import RoutedExpertsError

from .codec import decode_int32, encode_sglang, expand
from .layout import MoELayout
from .megatron_replay import load_replay, pack_replay_indices
from .merge import continuation_start, merge_segments, sample_routed_experts
from .slime_shape import bytes_per_token, for_trainer, to_slime_shape
from .validate import decode_compact
from .wire import decode_wire, engine_offers, opt_in, wire_layout

__all__ = [
    "MoELayout", "RoutedExpertsError", "bytes_per_token", "continuation_start", "decode_compact", "decode_int32",
    "decode_wire", "encode_sglang", "engine_offers", "expand", "for_trainer", "load_replay", "merge_segments",
    "opt_in", "pack_replay_indices", "sample_routed_experts", "to_slime_shape", "wire_layout",
]
