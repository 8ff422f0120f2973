"""Rollout-side view of a training config: which engines to start, where, with which budgets.

The YAML is parsed and checked by `training_configs.schema.load_config`; this module only adds the
rollout manager's derived objects (one `EngineSpec` per engine) and the model-path check.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Optional

from training_configs.schema import ConfigError, EngineGroup, TrainingConfig, load_config

__all__ = ["ConfigError", "EngineSpec", "TrainingConfig", "engine_specs", "load", "resolve_model"]


@dataclass
class EngineSpec:
    """One SGLang server to launch and supervise."""
    name: str            # "<group>-<index>", unique across groups
    group: EngineGroup
    index: int
    host: str
    port: int
    api_key: str         # "" = keyless engine (rollout.engine_auth: none)
    model_path: str
    device: str = "cpu"             # cluster.device: the command builder's profile
    gpus_per_node: int = 1          # cluster.gpus_per_node: nodes per engine = gpus_per_engine // this
    gpu_offset: int = 0             # global index of the engine's first GPU (slime's placement order)
    tokenizer_path: Optional[str] = None

    @property
    def nnodes(self) -> int:
        return max(1, self.group.gpus_per_engine // self.gpus_per_node)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def dp_size(self) -> int:
        """DP ranks `routed_dp_rank` reaches: attention-DP ranks or plain replicas alike."""
        return self.group.dp


def load(path) -> TrainingConfig:
    """Load and check a config file; raises ConfigError (one line) on any problem."""
    return load_config(path)


def resolve_model(cfg: TrainingConfig, root: str = ".", build: bool = True) -> str:
    """Absolute model path; builds the tiny CPU model when `model.build` says so and it is missing."""
    path = cfg.model.path
    local = path if os.path.isabs(path) else os.path.join(root, path)
    if cfg.model.build and build:
        from rollout.tiny_model import build_tiny_glm  # the engine area's builder (idempotent)
        return build_tiny_glm(local, seed=cfg.model.seed)
    if os.path.isdir(local):
        return os.path.abspath(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        where = os.path.basename(cfg.source) if cfg.source else cfg.name
        raise ConfigError(f"{where}: model.path: {path!r} does not exist (and model.build is not set)")
    return path  # "org/name": a hub id, SGLang resolves it


def engine_specs(cfg: TrainingConfig, model_path: str, api_key: str | None = None,
                 ports: list[int] | None = None) -> list[EngineSpec]:
    """One spec per engine of every group. Ports: `ports` if given, else base_port + 10*i."""
    key = "" if cfg.rollout.engine_auth == "none" else (api_key or cfg.rollout.api_key or secrets.token_hex(16))
    specs, i, gpu = [], 0, 0
    c = cfg.cluster
    for g in cfg.engine_groups:
        for k in range(g.engines):
            port = ports[i] if ports else cfg.rollout.base_port + 10 * i
            specs.append(EngineSpec(f"{g.name}-{k}", g, k, cfg.rollout.host, port, key, model_path,
                                    device=c.device, gpus_per_node=c.gpus_per_node, gpu_offset=gpu,
                                    tokenizer_path=cfg.model.tokenizer_path))
            i += 1
            gpu += g.gpus_per_engine
    return specs
