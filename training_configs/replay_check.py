"""`config check`: R3 with Megatron MTP layers (`mtp_num_layers`), the rule that applies.

SGLang captures the target model's layers only (`[tokens, num_hidden_layers, topk]`), so an MTP
layer's router has no captured route: it routes on its own (as NeMo-RL does; Miles bypasses R3 for
MTP). slime 624b824's `fill_routing_replay` instead asserts, since every router (the MTP ones too)
holds a `RoutingReplay` (slime#1556); `rollout.routed_experts.slime_replay_padding.install`, the
rendered `--custom-megatron-init-path`, takes the MTP routers out of replay
(`megatron_replay.load_replay(model=)` does the same for megatron-core's `RouterReplay`).
"""
from __future__ import annotations

from training_configs.render import REPLAY_PADDING_INIT, trainer_flags, user_megatron_init
from training_configs.schema import TrainingConfig


def mtp_replay(cfg: TrainingConfig) -> tuple[list, list]:
    """(notes, warnings) for MTP layers with R3; both empty without them."""
    flags = trainer_flags(cfg)
    mtp = int(flags.get("mtp_num_layers") or 0)
    routed = any(g.routed_experts for g in cfg.engine_groups)
    if mtp < 1 or not (routed or flags.get("use_rollout_routing_replay")):
        return [], []
    rule = (f"MTP layers (mtp_num_layers {mtp}) with R3: SGLang captures the target layers only, so the MTP "
            "routers route on their own")
    user = user_megatron_init(cfg)
    if user is not None:
        return [], [f"{rule}; your custom_megatron_init_path {user} must call {REPLAY_PADDING_INIT}(args), or "
                    "slime's fill_routing_replay asserts (slime#1556)"]
    if not routed or cfg.megatron is None:
        why = "no engine group sets routed_experts" if not routed else "the config has no megatron section"
        return [], [f"{rule}; {why}, so {REPLAY_PADDING_INIT} is not rendered as --custom-megatron-init-path and "
                    "slime's fill_routing_replay asserts (slime#1556)"]
    return [f"{rule} (the rendered --custom-megatron-init-path {REPLAY_PADDING_INIT} takes them out of "
            "slime's replay, which asserts otherwise: slime#1556)"], []
