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

With MTP layers (``args.mtp_num_layers``) ``install`` also wraps ``MegatronTrainRayActor.fill_routing_replay``:
slime's megatron patch gives every ``TopKRouter`` a ``RoutingReplay``, the MTP layers' too, but the captured
rows cover the target layers only, so slime's loop over the decoder's MoE layers ends short of
``RoutingReplay.all_routing_replays`` and asserts (slime#1556). The wrapper takes the MTP routers'
replays out of that list and lets those routers route on their own (``ROUTING_REPLAY_STAGE``
"fallthrough" for their forward), as NeMo-RL does; the decoder routers replay as before.

The targets are pinned by their source fingerprint, as the plugin's hooks on SGLang are
(``sglang_patches.in_place``): if slime's source differs, ``install`` changes nothing and says so
(stderr). Already using ``--custom-megatron-init-path``? Call ``install(args)`` from your own init function.
"""
import os
import sys

import numpy as np
import torch

from sglang_patches.in_place import wrap_in_place
from sglang_patches.registry import Hook, pin_problem

from .megatron_replay import mtp_routers
from .replay_padding import PAD, fill_pad_rows

CP_UTILS = "slime.backends.megatron_utils.cp_utils"
ACTOR = "slime.backends.megatron_utils.actor"
PAD_FN = "_pad_routed_experts"
PREPARE_FN = "prepare_routed_experts_for_routing_replay"
FILL_FN = "MegatronTrainRayActor.fill_routing_replay"
REVIEWED = {  # slime commit 624b824
    PAD_FN: "96e984beb3543043",
    PREPARE_FN: "6a0993eba4b00b15",
    FILL_FN: "0e0399a7e4499e7f",
}
OWN_ROUTES = "_slime_moe_rollout_own_routes"  # on an MTP router taken out of replay: the stage it saved


def mark_padding(original, experts, pad, num_experts):
    out = original(experts, pad, num_experts)
    if pad:
        if not out.dtype.is_signed:
            out = out.to(torch.int32)
        out[-pad:] = PAD
    return out


def spread_padding(ep_size: int):
    def prepare(original, *args, **kwargs):
        out = original(*args, **kwargs)
        rows = out.cpu().numpy().astype(np.int64)
        fill_pad_rows(rows, kwargs["num_experts"], ep_size)
        return out.new_tensor(rows)
    return prepare


def _own_routes_on(router, args):
    setattr(router, OWN_ROUTES, os.environ.get("ROUTING_REPLAY_STAGE"))
    os.environ["ROUTING_REPLAY_STAGE"] = "fallthrough"


def _own_routes_off(router, args, out):
    stage = getattr(router, OWN_ROUTES)
    if stage is None:
        os.environ.pop("ROUTING_REPLAY_STAGE", None)
    else:
        os.environ["ROUTING_REPLAY_STAGE"] = stage


def skip_mtp_routers(original, actor, *args, **kwargs):
    """slime's ``fill_routing_replay`` with the MTP routers out of replay (they route on their own)."""
    from slime.utils.routing_replay import RoutingReplay
    replays = RoutingReplay.all_routing_replays
    for router in mtp_routers(actor.model):
        own = getattr(router, "routing_replay", None)
        if own is None or hasattr(router, OWN_ROUTES):
            continue
        replays[:] = [r for r in replays if r is not own]
        setattr(router, OWN_ROUTES, None)
        router.register_forward_pre_hook(_own_routes_on)
        router.register_forward_hook(_own_routes_off)
    return original(actor, *args, **kwargs)


def mtp_pins(module: str = ACTOR) -> dict:
    """The MTP wrapper pinned to slime's reviewed ``fill_routing_replay``."""
    return {Hook(f"{module}.{FILL_FN}", skip_mtp_routers): REVIEWED[FILL_FN]}


def pins(ep_size: int = 1, module: str = CP_UTILS) -> dict:
    """The two wrappers pinned to slime's reviewed source (`sglang_patches.in_place`)."""
    return {Hook(f"{module}.{PAD_FN}", mark_padding): REVIEWED[PAD_FN],
            Hook(f"{module}.{PREPARE_FN}", spread_padding(ep_size)): REVIEWED[PREPARE_FN]}


def refusal(module: str = CP_UTILS) -> str:
    """Why ``install`` would not touch module ``module`` (empty when it would)."""
    return pin_problem(pins(module=module))


def install(args) -> bool:
    """slime's ``--custom-megatron-init-path`` entry point. True when the wrappers are in place."""
    ep_size = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    why = wrap_in_place(pins(ep_size), rebind=(ACTOR,))  # slime's actor imported the name before calling init
    if why:
        print(f"slime-moe-rollout: replay padding left as slime's: {why}", file=sys.stderr)
    mtp_why = wrap_in_place(mtp_pins()) if getattr(args, "mtp_num_layers", None) else ""
    if mtp_why:
        print(f"slime-moe-rollout: MTP routers left in slime's replay (it asserts with MTP layers, slime#1556): "
              f"{mtp_why}", file=sys.stderr)
    return not (why or mtp_why)
