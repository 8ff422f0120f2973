"""Render a training config into the flags slime or SGLang expect.

- `server_fields(cfg, group)`: the ServerArgs fields (name -> value) an engine of `group` runs with.
- `sglang_args(...)`: those fields as `sglang serve` / `python -m sglang.launch_server` flags.
- `slime_args(cfg, mode)`: slime's `train.py` flags (`--sglang-*`, `--rollout-num-gpus-per-engine`,
  `--use-rollout-routing-replay`, Megatron parallelism, our rollout function or external engines).
- `external_addrs(cfg)`: `host:port` of every managed engine (slime's `--rollout-external-engine-addrs`).

Flag spelling follows SGLang's convention (`--field-name`, booleans are bare `store_true` flags);
tests parse every rendered flag with SGLang's own `ServerArgs.add_cli_args` parser.
"""
from __future__ import annotations

import shlex

from training_configs.schema import ConfigError, EngineGroup, TrainingConfig
from training_configs.slime_check import slime_num_gpus_per_node

ADAPTER_ROLLOUT_FN = "rollout.slime.generate_rollout"
REPLAY_PADDING_INIT = "rollout.routed_experts.slime_replay_padding.install"  # slime#2308
ADAPTER_GENERATE_FN = "rollout.slime.generate"

# ServerArgs fields slime sets itself and does not register as --sglang-* (slime-contract §1).
SLIME_UNREGISTERED = frozenset({
    "model_path", "config", "trust_remote_code", "random_seed", "enable_memory_saver", "tp_size",
    "port", "nnodes", "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id", "nccl_port",
    "skip_server_warmup", "enable_return_routed_experts",
})
# Fields the rollout manager owns per engine (not part of a group's flags).
MANAGER_OWNED = frozenset({"host", "port", "api_key"})


def server_fields(cfg: TrainingConfig, group: EngineGroup, model_path: str | None = None) -> dict:
    """ServerArgs field values for one engine of `group` (insertion order = flag order)."""
    g = group
    f: dict = {"model_path": model_path or cfg.model.path}
    if cfg.model.tokenizer_path:
        f["tokenizer_path"] = cfg.model.tokenizer_path
    f["trust_remote_code"] = True
    f["tp_size"] = g.tp
    if g.pp > 1:
        f["pp_size"] = g.pp
    if g.dp > 1:
        f["dp_size"] = g.dp
    if g.ep > 1:
        f["ep_size"] = g.ep
    if g.moe_dense_tp is not None:
        f["moe_dense_tp_size"] = g.moe_dense_tp
    if g.enable_dp_attention:
        f["enable_dp_attention"] = True
    if g.enable_dp_lm_head:
        f["enable_dp_lm_head"] = True
    if g.moe_a2a_backend != "none":
        f["moe_a2a_backend"] = g.moe_a2a_backend
    s = g.speculative
    if s is not None:
        f["speculative_algorithm"] = s.algorithm
        if s.draft_model_path:
            f["speculative_draft_model_path"] = s.draft_model_path
        f["speculative_num_steps"] = s.num_steps
        f["speculative_eagle_topk"] = s.eagle_topk
        f["speculative_num_draft_tokens"] = s.num_draft_tokens
    if g.routed_experts:
        f["enable_return_routed_experts"] = True
    for name in ("chunked_prefill_size", "max_running_requests", "cuda_graph_max_bs", "mem_fraction_static"):
        value = getattr(g, name)
        if value is not None:
            f[name] = value
    for name, value in g.extra_sglang_args.items():
        if name in f:
            raise ConfigError(f"engine group {g.name!r}: extra_sglang_args.{name} duplicates a typed field; "
                              f"set it in the group instead")
        f[name] = value
    return f


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def fields_to_flags(fields: dict, prefix: str = "") -> list[str]:
    """`{tp_size: 32, enable_dp_attention: True}` -> `["--tp-size", "32", "--enable-dp-attention"]`."""
    out: list[str] = []
    for name, value in fields.items():
        flag = "--" + prefix + name.replace("_", "-")
        if value is None or value is False:
            continue  # store_true flags default to False; None means SGLang's default
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out.append(flag)
            out.extend(_scalar(v) for v in value)
        else:
            out.extend([flag, _scalar(value)])
    return out


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def sglang_args(cfg: TrainingConfig, group: EngineGroup, model_path: str | None = None) -> list[str]:
    return fields_to_flags(server_fields(cfg, group, model_path))


def external_addrs(cfg: TrainingConfig) -> list[str]:
    """`host:port` per engine, in the order the rollout manager assigns ports (base_port + 10*i)."""
    out, i = [], 0
    for g in cfg.engine_groups:
        for _ in range(g.engines):
            out.append(f"{cfg.rollout.host}:{cfg.rollout.base_port + 10 * i}")
            i += 1
    return out


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
            "--rollout-temperature", _scalar(r.sampling.temperature), "--rollout-top-p", _scalar(r.sampling.top_p)]
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
        user_init = {k.replace("-", "_") for k in [*mg.extra_args, *cfg.slime.extra_args]} & {"custom_megatron_init_path"}
        if g.routed_experts and not user_init:  # replay padding spread over EP ranks (slime#2308)
            out += ["--custom-megatron-init-path", REPLAY_PADDING_INIT]
    elif mode == "plugin":
        out += ["--rollout-num-gpus", str(g.engines * g.gpus_per_engine)]
    if mode == "managed":
        out += ["--rollout-external-engine-addrs", *(addrs or external_addrs(cfg))]
    else:
        out += ["--rollout-function-path", ADAPTER_ROLLOUT_FN]
    out += fields_to_flags({k.replace("-", "_"): v for k, v in cfg.slime.extra_args.items()})
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
