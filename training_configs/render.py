"""Render a training config into the flags slime or SGLang expect.

- `server_fields(cfg, group)`: the ServerArgs fields (name -> value) an engine of `group` runs with
  (`server_args`, the one mapping, which also launches the engines).
- `sglang_args(...)`: those fields as `sglang serve` / `python -m sglang.launch_server` flags.
- `slime_args(cfg, mode)`: slime's `train.py` flags (`--sglang-*`, `--rollout-num-gpus-per-engine`,
  `--use-rollout-routing-replay`, Megatron parallelism, our rollout function or external engines).
- `external_addrs(cfg)`: `host:port` of every managed engine (slime's `--rollout-external-engine-addrs`).

Flag spelling follows SGLang's convention (`--field-name`, booleans are bare `store_true` flags,
`server_args.fields_to_flags`); tests parse every rendered flag with SGLang's own `ServerArgs.add_cli_args` parser.
"""
from __future__ import annotations

import shlex

from training_configs.schema import ConfigError, EngineGroup, TrainingConfig
from training_configs.server_args import engine_port, fields_to_flags, scalar, server_fields
from training_configs.slime_check import slime_num_gpus_per_node

ADAPTER_ROLLOUT_FN = "rollout.slime.generate_rollout"
REPLAY_PADDING_INIT = "rollout.routed_experts.slime_replay_padding.install"  # slime#2308
ADAPTER_GENERATE_FN = "rollout.slime.generate"

# ServerArgs fields slime sets itself and does not register as --sglang-* flags.
SLIME_UNREGISTERED = frozenset({
    "model_path", "config", "trust_remote_code", "random_seed", "enable_memory_saver", "tp_size",
    "port", "nnodes", "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id", "nccl_port",
    "skip_server_warmup", "enable_return_routed_experts",
})


def trainer_flags(cfg: TrainingConfig) -> dict:
    """`megatron.extra_args` and `slime.extra_args` together, names with underscores (both go to slime's train.py)."""
    extra = {**(cfg.megatron.extra_args if cfg.megatron else {}), **cfg.slime.extra_args}
    return {k.replace("-", "_"): v for k, v in extra.items()}


def user_megatron_init(cfg: TrainingConfig):
    """The config's own `custom_megatron_init_path` (then `REPLAY_PADDING_INIT` is not rendered), or None."""
    return trainer_flags(cfg).get("custom_megatron_init_path")


def sglang_args(cfg: TrainingConfig, group: EngineGroup, model_path: str | None = None) -> list[str]:
    return fields_to_flags(server_fields(cfg, group, model_path))


def external_addrs(cfg: TrainingConfig) -> list[str]:
    """`host:port` per engine, on the ports the rollout manager assigns (`server_args.engine_port`)."""
    total = sum(g.engines for g in cfg.engine_groups)
    return [f"{cfg.rollout.host}:{engine_port(cfg.rollout.base_port, i)}" for i in range(total)]


def _kv(name: str, value) -> list[str]:
    return fields_to_flags({name: value})


def slime_args(cfg: TrainingConfig, mode: str | None = None, addrs: list[str] | None = None) -> list[str]:
    """slime `train.py` flags. mode: "plugin" (slime launches engines) or "managed" (ours, attached)."""
    mode = mode or cfg.slime.integration
    if len(cfg.engine_groups) != 1:
        raise ConfigError(f"slime-args: {len(cfg.engine_groups)} engine groups; slime's flags describe one "
                          "(several groups need slime's --sglang-config, which is not rendered)")
    g = cfg.engine_groups[0]
    fields = server_fields(cfg, g)
    out = ["--hf-checkpoint", cfg.model.path, "--rollout-num-gpus-per-engine", str(g.gpus_per_engine),
           "--num-gpus-per-node", str(slime_num_gpus_per_node(cfg, mode))]
    sglang = {k: v for k, v in fields.items() if k not in SLIME_UNREGISTERED}
    bad = sorted(set(g.extra_sglang_args) & SLIME_UNREGISTERED)
    if bad:
        raise ConfigError(f"slime-args: extra_sglang_args.{bad[0]} is set by slime itself and has no --sglang- flag")
    out += fields_to_flags(sglang, prefix="sglang-")
    if g.routed_experts:
        out.append("--use-rollout-routing-replay")  # slime then sets enable_return_routed_experts
    out += _kv("sglang_server_concurrency", cfg.rollout.concurrency_per_engine)
    r = cfg.rollout
    out += ["--rollout-batch-size", str(r.batch_size), "--n-samples-per-prompt", str(r.n_samples_per_prompt),
            "--rollout-max-response-len", str(r.sampling.max_new_tokens),
            "--rollout-temperature", scalar(r.sampling.temperature), "--rollout-top-p", scalar(r.sampling.top_p)]
    if r.sampling.top_k != -1:
        out += ["--rollout-top-k", str(r.sampling.top_k)]
    mg = cfg.megatron
    if mg is not None:
        out += ["--actor-num-nodes", str(mg.actor_num_nodes), "--actor-num-gpus-per-node",
                str(mg.actor_num_gpus_per_node)]
        if mg.colocate:
            out.append("--colocate")
        elif mode == "plugin":
            out += ["--rollout-num-gpus", str(g.engines * g.gpus_per_engine)]
        out += ["--tensor-model-parallel-size", str(mg.tp), "--pipeline-model-parallel-size", str(mg.pp),
                "--context-parallel-size", str(mg.cp), "--expert-model-parallel-size", str(mg.ep),
                "--expert-tensor-parallel-size", str(mg.etp)]
        if mg.sequence_parallel:
            out.append("--sequence-parallel")
        if mg.use_dynamic_batch_size:
            out.append("--use-dynamic-batch-size")
        if mg.max_tokens_per_gpu:
            out += ["--max-tokens-per-gpu", str(mg.max_tokens_per_gpu)]
        out += fields_to_flags({k.replace("-", "_"): v for k, v in mg.extra_args.items()})
        if g.routed_experts and user_megatron_init(cfg) is None:  # replay padding spread over EP ranks (slime#2308)
            out += ["--custom-megatron-init-path", REPLAY_PADDING_INIT]
    elif mode == "plugin":
        out += ["--rollout-num-gpus", str(g.engines * g.gpus_per_engine)]
    if mode == "managed":
        out += ["--rollout-external-engine-addrs", *(addrs or external_addrs(cfg))]
    else:
        out += ["--rollout-function-path", ADAPTER_ROLLOUT_FN]
    extra = {k.replace("-", "_"): v for k, v in cfg.slime.extra_args.items()}
    if extra.get("mask_offpolicy_in_partial_rollout") and not r.partial_rollout:
        raise ConfigError("slime-args: slime.extra_args.mask_offpolicy_in_partial_rollout needs "
                          "rollout.partial_rollout: true (slime reads it only with --partial-rollout)")
    if mode == "plugin" and r.partial_rollout and "partial_rollout" not in extra:
        out.append("--partial-rollout")   # plugin mode reads slime's flag: without it stragglers restart
    out += fields_to_flags(extra)
    return out


def render(cfg: TrainingConfig, fmt: str, group: str | None = None, mode: str | None = None) -> str:
    """Text for `config render --format FMT`."""
    if fmt == "sglang-args":
        groups = [cfg.group(group)] if group else cfg.engine_groups
        if len(groups) == 1:
            return shlex.join(sglang_args(cfg, groups[0]))
        return "\n".join(f"# group {g.name}\n{shlex.join(sglang_args(cfg, g))}" for g in groups)
    if fmt == "slime-args":
        return shlex.join(slime_args(cfg, mode))
    if fmt == "external-addrs":
        return " ".join(external_addrs(cfg))
    raise ConfigError(f"unknown format {fmt!r}")
