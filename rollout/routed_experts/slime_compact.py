"""Opt-in: slime keeps ``rollout_routed_experts`` compact until replay (plugin mode).

With ``SLIME_MOE_ROLLOUT_COMPACT_TRAINER=1`` in slime's rollout process the adapter hands slime each
sample's compact tensor as 2-D ``[len(tokens)-1, num_moe_layers * topk]`` uint8/int16 (712 B/token for
GLM-4.5 instead of slime's int32 2,944): slime's train data, its per-DP-rank split and the Ray objects it
puts stay compact. 2-D on purpose: a trainer without the trainer-side wrapper fails at once in slime's
``_pad_routed_experts`` (it unpacks three dimensions) instead of replaying the wrong layers. Two
wrappers, no slime code copied, each refusing (stderr, nothing changed) when slime's source differs from
the reviewed one:

- rollout side (installed by the adapter): ``validate_rollout_routed_experts_for_replay`` (defined in
  ``slime.observability.rollout_data_utils``, imported by name into ``slime.ray.rollout``, wrapped in
  both) runs slime's own validation on each sample expanded to slime's int32 shape, one sample at a time;
- trainer side (``--custom-megatron-init-path rollout.routed_experts.slime_compact.install``, also
  callable from your own init after ``slime_replay_padding.install``, in either order):
  ``prepare_routed_experts_for_routing_replay`` gets each compact sample of the microbatch expanded
  to slime's int32 shape, then slime's own preparation (and replay) runs as before.

The layout comes from slime's args (``num_layers``, ``moe_layer_freq``, ``num_experts``,
``moe_router_topk``); int32/int64 tensors pass through unchanged.
"""
import os
import sys

import torch

from sglang_patches.in_place import wrap_in_place
from sglang_patches.registry import Hook

from .codec import expand
from .layout import MoELayout

ENV = "SLIME_MOE_ROLLOUT_COMPACT_TRAINER"
ROLLOUT = "slime.ray.rollout"
ROLLOUT_DATA = "slime.observability.rollout_data_utils"
CP_UTILS = "slime.backends.megatron_utils.cp_utils"
ACTOR = "slime.backends.megatron_utils.actor"
VALIDATE_FN = "validate_rollout_routed_experts_for_replay"
PREPARE_FN = "prepare_routed_experts_for_routing_replay"
REVIEWED = {VALIDATE_FN: "675a66b5ad5a33b3", PREPARE_FN: "6a0993eba4b00b15"}   # slime commit 624b824


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def layout_from_args(args) -> MoELayout:
    freq = getattr(args, "moe_layer_freq", None)
    return MoELayout.from_layer_freq(1 if freq is None else freq, int(args.num_experts), int(args.moe_router_topk),
                                     int(args.num_layers))


def for_slime(compact_arr) -> torch.Tensor:
    """The adapter's hand-over: a compact ``[rows, num_moe_layers, topk]`` array as 2-D ``[rows, M * topk]``."""
    return torch.from_numpy(compact_arr.reshape(compact_arr.shape[0], -1))


def to_slime(experts, layout: MoELayout):
    """A compact tensor (2-D hand-over or 3-D) -> slime's int32 ``[rows, num_layers, topk]``; slime's own
    int32/int64 tensors are passed through."""
    t = torch.as_tensor(experts)
    if t.dtype in (torch.uint8, torch.int16):
        arr = t.numpy().reshape(t.shape[0], layout.num_moe_layers, layout.topk)
        return torch.from_numpy(expand(arr, layout))
    return t


class _Expanded:
    """A list of samples' routed experts seen in slime's shape, one sample expanded at a time."""

    def __init__(self, items, layout):
        self.items, self.layout = items, layout

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return (to_slime(x, self.layout) for x in self.items)

    def __getitem__(self, i):
        return to_slime(self.items[i], self.layout)


def _wrap(target: str, fn, rebind: tuple = ()) -> bool:
    """`fn` AROUND slime's `target`, pinned to its reviewed source (`sglang_patches.in_place`)."""
    why = wrap_in_place({Hook(target, fn): REVIEWED[target.rsplit(".", 1)[1]]}, rebind)
    if why:
        print(f"slime-moe-rollout: routed experts handed to slime as int32: {why}", file=sys.stderr)
    return not why


def _validate(original, routed_experts, args):
    return original(_Expanded(routed_experts, layout_from_args(args)), args)


def install_rollout_side() -> bool:
    """Wrap slime's R3 validation where its rollout manager calls it. True when in place."""
    return _wrap(f"{ROLLOUT_DATA}.{VALIDATE_FN}", _validate, rebind=(ROLLOUT,))   # its manager imported the name


def install(args) -> bool:
    """slime's ``--custom-megatron-init-path`` entry point (trainer side). True when in place."""
    layout = layout_from_args(args)

    def prepare(original, rollout_routed_experts, *a, **kw):
        return original([to_slime(x, layout) for x in rollout_routed_experts], *a, **kw)
    return _wrap(f"{CP_UTILS}.{PREPARE_FN}", prepare, rebind=(ACTOR,))  # slime's actor imported the name
