"""Typed schema of a slime-moe-rollout training config (YAML), and its loader.

One YAML file describes one RL job: the model, the SGLang engine groups that serve rollouts, the
rollout loop, the Megatron trainer and extra slime flags. The rollout manager (`rollout/`), the
validator (`slime-moe-rollout config check`) and the renderer (`config render`) all read it through
`load_config(path)`, which returns a `TrainingConfig` or raises `ConfigError` with ONE line naming
the field, e.g. `tiny-cpu.yaml: engine_groups[0].tp: expected an integer, got 'two'`.

Top-level keys (unknown keys anywhere are an error, so typos are caught):

  name: str                       config name (defaults to the file stem)
  description: str
  model:                          ModelConfig - facts from the HF config.json
    path: str                     HF id or local directory
    tokenizer_path: str|null      defaults to path
    architecture: str             e.g. Glm4MoeForCausalLM
    num_layers: int               num_hidden_layers (dense + MoE, no MTP layers)
    num_experts: int              n_routed_experts
    topk: int                     num_experts_per_tok
    first_k_dense_replace: int    leading dense layers (GLM-4.5: 3)
    num_shared_experts: int
    num_nextn_predict_layers: int MTP layers (EAGLE draft without a separate draft model)
    hidden_size, num_attention_heads, num_key_value_heads, vocab_size: int|null
    build: str|null               local builder of the checkpoint at `path`: "tiny-glm45" or "near-tie-glm45"
    seed: int                     seed for `build`
  cluster:                        ClusterConfig
    nodes: int, gpus_per_node: int, device: "cuda"|"cpu"
  engine_groups: list             EngineGroup, at least one
    - name: str                   unique
      engines: int                number of SGLang servers in this group
      gpus_per_engine: int        slime's --rollout-num-gpus-per-engine (= tp * pp)
      tp, dp, ep, pp: int         SGLang --tp-size / --dp-size / --ep-size / --pp-size
      moe_dense_tp: int|null      --moe-dense-tp-size
      enable_dp_attention: bool   --enable-dp-attention (dp > 1 requires it)
      enable_dp_lm_head: bool     --enable-dp-lm-head (requires DP attention)
      moe_a2a_backend: str        --moe-a2a-backend ("none", "deepep", ...)
      speculative:                null, or SpeculativeConfig
        algorithm: EAGLE|EAGLE3|NEXTN|STANDALONE
        num_steps, eagle_topk, num_draft_tokens: int
        draft_model_path: str|null
      routed_experts: bool        --enable-return-routed-experts (slime: --use-rollout-routing-replay)
      chunked_prefill_size, max_running_requests, cuda_graph_max_bs: int|null
      mem_fraction_static: float|null  in (0, 1)
      extra_sglang_args: dict     more ServerArgs fields by name (underscores), e.g. attention_backend
      env: dict[str, str]         environment for the engine processes
      expected: dict              values a source document states (attn_tp_size, require_mlp_tp_gather,
                                  require_attn_tp_gather); `config check` warns where SGLang differs
  rollout:                        RolloutConfig
    batch_size: int               prompt groups per rollout step (slime --rollout-batch-size)
    n_samples_per_prompt: int     GRPO group size
    sampling: {temperature: float, top_p: float, top_k: int, max_new_tokens: int}
    concurrency_per_engine: int   in-flight requests per engine
    host: str, base_port: int     engines bind host:base_port + 10*i (managed mode)
    api_key: str|null             null: the manager generates one
    engine_auth: "key"|"none"     none: engines take no API key (slime's managed mode sends none);
                                  they then bind only `host` (loopback, or a private interface)
    restart_checkpoint: str|null  `serve`: weights a restarted engine loads before it may serve again
                                  (else it stays paused until its weight_version equals its peers')
    partial_rollout: bool         return aborted stragglers with tokens so far
    group_placement: "group"|"sample"  group: each group on one (engine, DP rank), prompt prefilled once;
                                  sample: each sample to the least-busy engine, the engine picks the rank
    budgets:                      seconds per readiness phase
      process_s, http_s, server_up_s, health_generate_s, dp_probe_s: float
    health: {interval_s: float, timeout_s: float, failures: int}
  megatron:                       MegatronConfig (trainer side; may be omitted for rollout-only use)
    tp, pp, cp, ep, etp: int, sequence_parallel: bool,
    actor_num_nodes, actor_num_gpus_per_node: int, colocate: bool,
    max_tokens_per_gpu: int|null, use_dynamic_batch_size: bool, extra_args: dict
  slime:                          SlimeConfig
    integration: "plugin"|"managed"   who launches the engines (see docs/slime.md)
    extra_args: dict              more slime flags by name (underscores or dashes, no leading --)

Structural checks done here (no SGLang import): types, ranges, tp % dp, tp % ep, gpus_per_engine
== tp * pp, dp > 1 needs DP attention, dp-lm-head needs DP attention, unique group names. The
SGLang-derived checks (attn_tp_size, gathers, EAGLE constraints, fixes) live in `check.py`.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A config problem, as one line naming the field."""


def _f(default=dataclasses.MISSING, *, choices=None, min=None, max=None, factory=None, **kw):
    meta = {"choices": choices, "min": min, "max": max}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str = _f()
    num_layers: int = _f(min=1)
    num_experts: int = _f(min=1)
    topk: int = _f(min=1)
    first_k_dense_replace: int = _f(0, min=0)
    num_shared_experts: int = _f(0, min=0)
    num_nextn_predict_layers: int = _f(0, min=0)
    architecture: str = ""
    tokenizer_path: Optional[str] = None
    hidden_size: Optional[int] = _f(None, min=1)
    num_attention_heads: Optional[int] = _f(None, min=1)
    num_key_value_heads: Optional[int] = _f(None, min=1)
    vocab_size: Optional[int] = _f(None, min=1)
    build: Optional[str] = _f(None, choices=("tiny-glm45", "near-tie-glm45"))
    seed: int = 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace


@dataclass
class ClusterConfig:
    nodes: int = _f(1, min=1)
    gpus_per_node: int = _f(8, min=1)
    device: str = _f("cuda", choices=("cuda", "cpu"))

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class SpeculativeConfig:
    algorithm: str = _f(choices=("EAGLE", "EAGLE3", "NEXTN", "STANDALONE"))
    num_steps: int = _f(min=1)
    eagle_topk: int = _f(min=1)
    num_draft_tokens: int = _f(min=1)
    draft_model_path: Optional[str] = None


@dataclass
class EngineGroup:
    name: str = _f()
    engines: int = _f(min=1)
    gpus_per_engine: int = _f(min=1)
    tp: int = _f(min=1)
    dp: int = _f(1, min=1)
    ep: int = _f(1, min=1)
    pp: int = _f(1, min=1)
    moe_dense_tp: Optional[int] = _f(None, min=1)
    enable_dp_attention: bool = False
    enable_dp_lm_head: bool = False
    moe_a2a_backend: str = "none"
    speculative: Optional[SpeculativeConfig] = None
    routed_experts: bool = False
    chunked_prefill_size: Optional[int] = _f(None, min=-1)
    max_running_requests: Optional[int] = _f(None, min=1)
    cuda_graph_max_bs: Optional[int] = _f(None, min=1)
    mem_fraction_static: Optional[float] = _f(None, min=0.01, max=0.99)
    extra_sglang_args: dict[str, Any] = _f(factory=dict)
    env: dict[str, str] = _f(factory=dict)
    expected: dict[str, Any] = _f(factory=dict)

    @property
    def attn_dp_size(self) -> int:
        return self.dp if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        """SGLang 0.5.23: tp // attn_dp // attn_cp (attn_cp is 1 here)."""
        return self.tp // self.attn_dp_size


@dataclass
class SamplingConfig:
    temperature: float = _f(1.0, min=0.0)
    top_p: float = _f(1.0, min=0.0, max=1.0)
    top_k: int = _f(-1, min=-1)
    max_new_tokens: int = _f(1024, min=1)


@dataclass
class ReadinessBudgets:
    """Seconds allowed per start-up phase (process alive -> HTTP up -> status Up ->
    /health_generate 200 -> one-token probe on every DP rank)."""
    process_s: float = _f(30.0, min=0.1)
    http_s: float = _f(600.0, min=0.1)
    server_up_s: float = _f(1800.0, min=0.1)
    health_generate_s: float = _f(600.0, min=0.1)
    dp_probe_s: float = _f(300.0, min=0.1)

    @property
    def total_s(self) -> float:
        return self.process_s + self.http_s + self.server_up_s + self.health_generate_s + self.dp_probe_s


@dataclass
class HealthConfig:
    interval_s: float = _f(30.0, min=0.1)
    timeout_s: float = _f(30.0, min=0.1)
    failures: int = _f(3, min=1)


@dataclass
class RolloutConfig:
    batch_size: int = _f(min=1)
    n_samples_per_prompt: int = _f(min=1)
    sampling: SamplingConfig = _f(factory=SamplingConfig)
    concurrency_per_engine: int = _f(64, min=1)
    host: str = "127.0.0.1"
    base_port: int = _f(30000, min=1024, max=65000)
    api_key: Optional[str] = None
    engine_auth: str = _f("key", choices=("key", "none"))
    restart_checkpoint: Optional[str] = None
    partial_rollout: bool = True
    group_placement: str = _f("group", choices=("group", "sample"))
    budgets: ReadinessBudgets = _f(factory=ReadinessBudgets)
    health: HealthConfig = _f(factory=HealthConfig)


@dataclass
class MegatronConfig:
    tp: int = _f(1, min=1)
    pp: int = _f(1, min=1)
    cp: int = _f(1, min=1)
    ep: int = _f(1, min=1)
    etp: int = _f(1, min=1)
    sequence_parallel: bool = False
    actor_num_nodes: int = _f(1, min=1)
    actor_num_gpus_per_node: int = _f(8, min=1)
    colocate: bool = True
    max_tokens_per_gpu: Optional[int] = _f(None, min=1)
    use_dynamic_batch_size: bool = False
    extra_args: dict[str, Any] = _f(factory=dict)

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass
class SlimeConfig:
    integration: str = _f("plugin", choices=("plugin", "managed"))
    extra_args: dict[str, Any] = _f(factory=dict)


@dataclass
class TrainingConfig:
    model: ModelConfig = _f()
    engine_groups: list[EngineGroup] = _f()
    rollout: RolloutConfig = _f()
    name: str = ""
    description: str = ""
    cluster: ClusterConfig = _f(factory=ClusterConfig)
    megatron: Optional[MegatronConfig] = None
    slime: SlimeConfig = _f(factory=SlimeConfig)
    source: str = field(default="", metadata={"internal": True})  # file it was loaded from

    def group(self, name: str) -> EngineGroup:
        for g in self.engine_groups:
            if g.name == name:
                return g
        raise KeyError(name)


# ---------------------------------------------------------------- generic typed loading

_SCALARS = (str, int, float, bool)


def _type_name(tp) -> str:
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            dict: "a mapping", list: "a list"}.get(typing.get_origin(tp) or tp, str(tp))


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where}: keys must be strings, got {k!r}")
            if vt is str:
                if not isinstance(v, _SCALARS):
                    raise ConfigError(f"{where}.{k}: expected a string, got {v!r}")
                v = str(v) if not isinstance(v, bool) else ("1" if v else "0")
            elif not (v is None or isinstance(v, _SCALARS)
                      or (isinstance(v, list) and all(isinstance(x, _SCALARS) for x in v))):
                raise ConfigError(f"{where}.{k}: expected a scalar or a list of scalars, got {v!r}")
            out[k] = v
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {where}")  # programming error


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'top level'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in fields:
            raise ConfigError(f"{prefix}{key}: unknown field (allowed: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        path = f"{prefix}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{path}: missing required field")
            continue
        value = _convert(hints[name], data[name], path)
        meta = f.metadata
        if value is not None:
            if meta.get("choices") and value not in meta["choices"]:
                raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(str, meta['choices']))}")
            if meta.get("min") is not None and value < meta["min"]:
                raise ConfigError(f"{path}: must be >= {meta['min']}, got {value!r}")
            if meta.get("max") is not None and value > meta["max"]:
                raise ConfigError(f"{path}: must be <= {meta['max']}, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


# ---------------------------------------------------------------- structural checks

def _check_structure(cfg: TrainingConfig) -> None:
    m = cfg.model
    if m.topk > m.num_experts:
        raise ConfigError(f"model.topk: {m.topk} exceeds model.num_experts {m.num_experts}")
    if m.first_k_dense_replace >= m.num_layers:
        raise ConfigError(f"model.first_k_dense_replace: {m.first_k_dense_replace} leaves no MoE layer "
                          f"(num_layers {m.num_layers})")
    if not cfg.engine_groups:
        raise ConfigError("engine_groups: at least one engine group is required")
    seen = set()
    for i, g in enumerate(cfg.engine_groups):
        w = f"engine_groups[{i}]"
        if not g.name:
            raise ConfigError(f"{w}.name: must not be empty")
        if g.name in seen:
            raise ConfigError(f"{w}.name: duplicate group name {g.name!r}")
        seen.add(g.name)
        if g.gpus_per_engine != g.tp * g.pp:
            raise ConfigError(f"{w}.gpus_per_engine: {g.gpus_per_engine} != tp*pp = {g.tp * g.pp}")
        if g.tp % g.dp:
            raise ConfigError(f"{w}.tp: tp {g.tp} is not divisible by dp {g.dp}")
        if g.tp % g.ep:
            raise ConfigError(f"{w}.ep: tp {g.tp} is not divisible by ep {g.ep}")
        if g.dp > 1 and not g.enable_dp_attention:
            raise ConfigError(f"{w}.dp: dp {g.dp} > 1 requires enable_dp_attention (slime asserts it)")
        if g.enable_dp_attention and g.dp < 2:
            raise ConfigError(f"{w}.enable_dp_attention: needs dp >= 2, got dp {g.dp}")
        if g.enable_dp_lm_head and not g.enable_dp_attention:
            raise ConfigError(f"{w}.enable_dp_lm_head: requires enable_dp_attention")
        if g.moe_dense_tp is not None and g.moe_dense_tp not in (1, g.tp):
            raise ConfigError(f"{w}.moe_dense_tp: SGLang supports 1 or tp ({g.tp}), got {g.moe_dense_tp}")
        if g.ep > m.num_experts or m.num_experts % g.ep:
            raise ConfigError(f"{w}.ep: num_experts {m.num_experts} is not divisible by ep {g.ep}")
        if g.gpus_per_engine > cfg.cluster.gpus_per_node and g.gpus_per_engine % cfg.cluster.gpus_per_node:
            raise ConfigError(f"{w}.gpus_per_engine: {g.gpus_per_engine} spans nodes but is not a multiple "
                              f"of cluster.gpus_per_node {cfg.cluster.gpus_per_node}")
        for k in g.extra_sglang_args:
            if k.startswith("-") or "-" in k:
                raise ConfigError(f"{w}.extra_sglang_args.{k}: use the ServerArgs field name (underscores, no --)")
    used = sum(g.engines * g.gpus_per_engine for g in cfg.engine_groups)
    if used > cfg.cluster.total_gpus:
        raise ConfigError(f"engine_groups: {used} GPUs requested but cluster has "
                          f"{cfg.cluster.nodes}x{cfg.cluster.gpus_per_node} = {cfg.cluster.total_gpus}")
    mg = cfg.megatron
    if mg is not None:
        model_par = mg.tp * mg.pp * mg.cp
        if mg.world_size % model_par:
            raise ConfigError(f"megatron: world size {mg.world_size} is not divisible by tp*pp*cp = {model_par}")
        if mg.world_size > cfg.cluster.total_gpus:
            raise ConfigError(f"megatron: {mg.world_size} actor GPUs exceed the cluster's {cfg.cluster.total_gpus}")
        if m.num_experts % mg.ep:
            raise ConfigError(f"megatron.ep: num_experts {m.num_experts} is not divisible by ep {mg.ep}")
        if (mg.world_size // mg.pp) % (mg.ep * mg.etp):
            raise ConfigError(f"megatron.ep: ep*etp {mg.ep * mg.etp} does not divide the per-stage "
                              f"world size {mg.world_size // mg.pp}")
        if mg.sequence_parallel and mg.tp == 1:
            raise ConfigError("megatron.sequence_parallel: needs tp > 1")
        if not mg.colocate and used + mg.world_size > cfg.cluster.total_gpus:
            raise ConfigError(f"megatron.colocate: false needs {mg.world_size} + {used} GPUs, cluster has "
                              f"{cfg.cluster.total_gpus}")


# ---------------------------------------------------------------- entry points

def parse_config(data, name: str = "") -> TrainingConfig:
    """Build and structurally check a config from already-parsed YAML data."""
    cfg = _build(TrainingConfig, data, "")
    if not cfg.name:
        cfg.name = name
    _check_structure(cfg)
    return cfg


def load_config(path) -> TrainingConfig:
    """Load a YAML config; raises ConfigError with one line '<file>: <field>: <problem>'."""
    path = os.fspath(path)
    base = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{base}: invalid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{base}: file is empty")
    try:
        cfg = parse_config(data, name=os.path.splitext(base)[0])
    except ConfigError as e:
        raise ConfigError(f"{base}: {e}") from None
    cfg.source = path
    return cfg


def shipped_configs() -> list[str]:
    """Paths of the YAML configs shipped in this package."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".yaml"))
