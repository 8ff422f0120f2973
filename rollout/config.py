"""Rollout-side view of a training config: which engines to start, where, with which budgets.

The YAML is parsed and checked by `training_configs.schema.load_config`; this module only adds the
rollout manager's derived objects (one `EngineSpec` per engine) and the names
of the single-engine CPU configurations (`PRESETS`: `engine launch --config a|b|c`, tests, benchmarks).
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Optional

from training_configs import schema
from training_configs.schema import ConfigError, EngineGroup, TrainingConfig, load_config
from training_configs.server_args import engine_port

__all__ = ["ConfigError", "EngineSpec", "PRESETS", "TrainingConfig", "engine_specs", "load", "preset_path"]

CONFIG_DIR = os.path.dirname(os.path.abspath(schema.__file__))
# One engine of the tiny GLM-4.5 MoE on CPU each: name -> (file in training_configs/, what it runs)
PRESETS = {
    "a": ("tiny-cpu-r3.yaml", "single rank + routed experts"),
    "b": ("tiny-cpu-nextn.yaml", "single rank + routed experts + NEXTN (2 steps, top-k 1, 3 draft tokens)"),
    "c": ("tiny-cpu-dpattn.yaml", "DP attention tp 4 / dp 2 (attn_tp 2), ep 4, moe-dense-tp 1, dp-lm-head, "
                                  "NEXTN, routed experts"),
}


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


def preset_path(name: str) -> str:
    """The config file of a preset name (`a`, `b`, `c`); any other name is returned as given (a path)."""
    return os.path.join(CONFIG_DIR, PRESETS[name][0]) if name in PRESETS else name


def load(path) -> TrainingConfig:
    """Load and check a config file (or a preset name); raises ConfigError (one line) on any problem."""
    return load_config(preset_path(os.fspath(path)))


def engine_specs(cfg: TrainingConfig, model_path: str, api_key: str | None = None,
                 ports: list[int] | None = None) -> list[EngineSpec]:
    """One spec per engine of every group. Ports: `ports` if given, else `server_args.engine_port`."""
    key = "" if cfg.rollout.engine_auth == "none" else (api_key or cfg.rollout.api_key or secrets.token_hex(16))
    specs, i, gpu = [], 0, 0
    c = cfg.cluster
    for g in cfg.engine_groups:
        for k in range(g.engines):
            port = ports[i] if ports else engine_port(cfg.rollout.base_port, i)
            specs.append(EngineSpec(f"{g.name}-{k}", g, k, cfg.rollout.host, port, key, model_path,
                                    device=c.device, gpus_per_node=c.gpus_per_node, gpu_offset=gpu,
                                    tokenizer_path=cfg.model.tokenizer_path))
            i += 1
            gpu += g.gpus_per_engine
    return specs
