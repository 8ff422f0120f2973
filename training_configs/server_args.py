"""The one mapping from a config's engine group to SGLang ServerArgs fields, their flag spelling, and
the engine port rule. The rollout's command builder launches engines with it; `config render` prints it
and `config check` checks it.

Ports: engine i of a config listens on `engine_port(base_port, i)`; engines are PORTS_PER_ENGINE apart
and an engine's other ports (NCCL, dist-init, health stub) lie in between.
"""
from __future__ import annotations

from typing import Optional

from training_configs.schema import ConfigError, EngineGroup, TrainingConfig

PORTS_PER_ENGINE = 10


def engine_port(base_port: int, index: int) -> int:
    """HTTP port of the index-th engine of a config."""
    return base_port + PORTS_PER_ENGINE * index


def group_fields(group: EngineGroup, model_path: str, tokenizer_path: Optional[str] = None) -> dict:
    """ServerArgs field values of one engine of `group` (insertion order = flag order); the node's
    host, port, key and device profile are added by the command builder."""
    g = group
    f: dict = {"model_path": model_path}
    if tokenizer_path:
        f["tokenizer_path"] = tokenizer_path
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


def server_fields(cfg: TrainingConfig, group: EngineGroup, model_path: Optional[str] = None) -> dict:
    """ServerArgs field values for one engine of `group` of `cfg`."""
    return group_fields(group, model_path or cfg.model.path, cfg.model.tokenizer_path)


def fields_to_flags(fields: dict, prefix: str = "") -> list[str]:
    """`{tp_size: 32, enable_dp_attention: True}` -> `["--tp-size", "32", "--enable-dp-attention"]`.
    SGLang's spelling: `--field-name`, booleans are bare store_true flags (False and None: left out)."""
    out: list[str] = []
    for name, value in fields.items():
        flag = "--" + prefix + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out.append(flag)
            out.extend(scalar(v) for v in value)
        else:
            out.extend([flag, scalar(value)])
    return out


def scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
