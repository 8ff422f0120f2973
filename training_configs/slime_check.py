"""`config check` for slime's managed mode (`serve` + slime's `--rollout-external-engine-addrs`).

What slime 0.3.1 (624b824) does with external engines, and so what is checked here:
- `discover_external_engines`, slime's router and its control calls send no API key: managed engines
  must run keyless (`rollout.engine_auth: none`), which is safe only on loopback or a private interface
  (a non-loopback host needs `rollout.allow_unauthenticated_network: true`, see `schema.keyless_network_problem`).
- `SGLangEngine._init_external` compares `/server_info` with what slime would launch, except the fields in
  `_EXTERNAL_ENGINE_SKIP_CHECK_FIELDS` (tp/dp/pp/ep, ports, ...). Compared: `enable_memory_saver`
  (== slime's `offload_rollout`: `--offload`, `--offload-rollout`, or `--colocate`), and
  `enable_return_routed_experts` (with `--use-rollout-routing-replay`), `dtype` "float16" (with `--fp16`).
- one actor per address, `node_rank = rank % max(1, num_gpus // --num-gpus-per-node)`, where num_gpus is
  the engine's tp*pp from `/server_info`; only node_rank 0 registers with the router and gets weight
  updates. The rendered `--num-gpus-per-node` is therefore at least `gpus_per_engine` (see render.py).
"""
from __future__ import annotations

from training_configs.schema import LOOPBACK, ConfigError, TrainingConfig
from training_configs.server_args import server_fields

WILDCARD = ("0.0.0.0", "::", "")


def _slime_flag(cfg: TrainingConfig, name: str) -> bool:
    extra = {k.replace("-", "_"): v for k, v in cfg.slime.extra_args.items()}
    return bool(extra.get(name, False))


def slime_offload_rollout(cfg: TrainingConfig) -> bool:
    """slime's `args.offload_rollout` for this config (slime/utils/arguments.py)."""
    colocate = cfg.megatron is not None and cfg.megatron.colocate
    return _slime_flag(cfg, "offload") or _slime_flag(cfg, "offload_rollout") or colocate


def managed_checks(cfg: TrainingConfig) -> list:
    """Raise ConfigError (one line) where slime would refuse or cannot reach the engines; return warnings."""
    r = cfg.rollout
    if r.engine_auth != "none":
        raise ConfigError("rollout.engine_auth: slime.integration managed needs 'none': slime's discovery, router "
                          "and control calls send no API key, so keyed engines answer 401")
    warnings = []
    if r.host in WILDCARD:
        warnings.append(f"rollout.host {r.host!r}: keyless engines listen on EVERY interface; anyone who can reach "
                        "them can generate and change weights. Use loopback or a private cluster interface")
    elif not r.host.startswith(LOOPBACK):
        warnings.append(f"rollout.host {r.host}: keyless engines accept any client that can reach {r.host}; keep "
                        "it a private cluster interface")
    fp16 = _slime_flag(cfg, "fp16")
    r3 = _slime_flag(cfg, "use_rollout_routing_replay")
    for g in cfg.engine_groups:
        f = server_fields(cfg, g)
        saver, offload = bool(f.get("enable_memory_saver", False)), slime_offload_rollout(cfg)
        if saver != offload:
            raise ConfigError(f"group {g.name}: slime compares enable_memory_saver ({saver}) with its offload_rollout "
                              f"({offload}); managed engines must match (no --colocate/--offload-rollout)")
        if (g.routed_experts or r3) and not f.get("enable_return_routed_experts"):
            raise ConfigError(f"group {g.name}: slime's --use-rollout-routing-replay expects "
                              "enable_return_routed_experts on the engines; set routed_experts: true")
        if fp16 and f.get("dtype") != "float16":
            raise ConfigError(f"group {g.name}: slime's --fp16 expects engines with dtype float16, the config "
                              f"gives {f.get('dtype', 'auto')!r}; set extra_sglang_args.dtype: float16")
    return warnings


def slime_num_gpus_per_node(cfg: TrainingConfig, mode: str) -> int:
    """slime's `--num-gpus-per-node`: the cluster's, raised in managed mode to the widest engine so that
    slime's external-mode `node_rank` is 0 for every address (each address is one whole engine)."""
    n = cfg.cluster.gpus_per_node
    if mode == "managed":
        n = max([n] + [g.gpus_per_engine for g in cfg.engine_groups])
    return n
