"""slime's routing-replay padding spread over EP ranks, installed in slime's own trainer process.

slime (624b824) pads rollout routed experts in ``cp_utils._pad_routed_experts`` with
``arange(pad * layers * topk) % num_experts``, restarted at every call: each sample's pad row gets
the same contiguous expert block per layer, so one or two EP ranks take every pad token
(slime#2308). slime's hook point: ``--custom-megatron-init-path
rollout.routed_experts.slime_replay_padding.install`` (called with ``args`` in every Megatron
actor after parallel state is set up). ``install`` wraps two slime functions, no slime code copied:

- ``_pad_routed_experts``: slime's own padding, then its new rows marked ``-1``;
- ``prepare_routed_experts_for_routing_replay`` (also the name bound in slime's ``actor`` module):
  slime's own layout, CP and SP slicing, then the marked rows of this rank's slice get
  ``replay_padding.fill_pad_rows`` (ordinals after slicing, layer = slime's layer column) with the
  trainer's ``expert_model_parallel_size``; a partially padded row is refused.

Both targets are pinned by ``sha256(inspect.getsource)[:16]``: if slime's source differs,
``install`` changes nothing and says so (stderr). Already using ``--custom-megatron-init-path``?
Call ``install(args)`` from your own init function.
"""
import functools
import importlib
import inspect
import sys

import numpy as np
import torch

from .replay_padding import PAD, fill_pad_rows

CP_UTILS = "slime.backends.megatron_utils.cp_utils"
ACTOR = "slime.backends.megatron_utils.actor"
PAD_FN = "_pad_routed_experts"
PREPARE_FN = "prepare_routed_experts_for_routing_replay"
REVIEWED = {  # slime commit 624b824
    PAD_FN: "96e984beb3543043",
    PREPARE_FN: "6a0993eba4b00b15",
}
MARK = "_slime_moe_rollout_wrapped"


def _digest(fn) -> str:
    from sglang_patches.fingerprint import digest
    return digest(inspect.getsource(fn))


def refusal(mod) -> str:
    """Why ``install`` would not touch module ``mod`` (empty when it would)."""
    for name, want in REVIEWED.items():
        fn = getattr(mod, name, None)
        if fn is None:
            return f"{mod.__name__}.{name} is missing"
        fn = getattr(fn, "__wrapped__", fn)
        if (got := _digest(fn)) != want:
            return f"{mod.__name__}.{name} changed (fingerprint {got} != reviewed {want})"
    return ""


def mark_padding(original):
    @functools.wraps(original)
    def pad(experts, pad, num_experts):
        out = original(experts, pad, num_experts)
        if pad:
            if not out.dtype.is_signed:
                out = out.to(torch.int32)
            out[-pad:] = PAD
        return out
    return pad


def spread_padding(original, ep_size: int):
    @functools.wraps(original)
    def prepare(*args, **kwargs):
        out = original(*args, **kwargs)
        rows = out.cpu().numpy().astype(np.int64)
        fill_pad_rows(rows, kwargs["num_experts"], ep_size)
        return out.new_tensor(rows)
    return prepare


def install(args) -> bool:
    """slime's ``--custom-megatron-init-path`` entry point. True when the wrappers are in place."""
    mod = importlib.import_module(CP_UTILS)
    if getattr(mod, MARK, False):
        return True
    if why := refusal(mod):
        print(f"slime-moe-rollout: replay padding left as slime's: {why}", file=sys.stderr)
        return False
    ep_size = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    original = getattr(mod, PREPARE_FN)
    wrapped = spread_padding(original, ep_size)
    setattr(mod, PAD_FN, mark_padding(getattr(mod, PAD_FN)))
    setattr(mod, PREPARE_FN, wrapped)
    actor = sys.modules.get(ACTOR)  # slime's actor imported the name before calling init
    if actor is not None and getattr(actor, PREPARE_FN, None) is original:
        setattr(actor, PREPARE_FN, wrapped)
    setattr(mod, MARK, True)
    return True
