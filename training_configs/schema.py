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
    concurrency_per_engine: int   in-flight samples per engine (placement adds a primer per fresh group)
    host: str, base_port: int     engines bind host:base_port + 10*i (managed mode)
    api_key: str|null             null: the manager generates one
    engine_auth: "key"|"none"     none: engines take no API key (slime's managed mode sends none);
                                  they then bind only `host`, which must be loopback unless
    allow_unauthenticated_network: bool  true: keyless engines may bind a non-loopback host (a private
                                  cluster interface); anyone reaching the port can change weights
    allow_unfixed: bool           true: admit engines whose needed fixes are not active (stock SGLang)
    restart_checkpoint: str|null  `serve`: weights a restarted engine loads before it may serve again
                                  (else it stays paused until its weight_version equals its peers')
    weight_update_pause: "retract"|"abort"|null  how an abort-mode /pause_generation (slime's, at every weight
                                  update) pauses: retract keeps the requests in flight (they resume under the new
                                  weights); null: retract where the engine returns routed experts, else abort.
                                  The engines get it as SLIME_MOE_ROLLOUT_WEIGHT_UPDATE_PAUSE (docs/fixes.md)
    partial_rollout: bool         return aborted stragglers with tokens so far
    group_placement: "group"|"sample"  group: each group on one (engine, DP rank), prompt prefilled once;
                                  sample: each sample to the least-busy engine, the engine picks the rank
    max_weight_version_lag: int|null  slime fully-async rollout, run, serve: a group whose oldest token is more weight
                                  versions behind the current one is never delivered (null: no bound)
    stale_groups: "regenerate"|"drop"  what happens to such a group instead (counted: rollout/stale_groups)
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

The models are pydantic v2 models: types (strict: `true` is no integer), ranges and choices are declared
on the fields, cross-field rules (tp % dp, tp % ep, gpus_per_engine == tp * pp, dp > 1 needs DP attention,
dp-lm-head needs DP attention, unique group names, GPUs and Megatron parallelism vs the cluster) on the
models; `load_config` turns pydantic's first error into the one-line `ConfigError`, and
`json_schema()` (`config schema`) is the JSON schema editors can use. The SGLang-derived checks
(attn_tp_size, gathers, EAGLE constraints, fixes) live in `check.py`.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Callable, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from sglang_patches.errors import CliError

Count = Annotated[int, Field(ge=1)]  # a size, count or parallel degree
BASE_PORTS = (1024, 65000)  # rollout.base_port (and --base-port, --port) lie in this range


class ConfigError(CliError, ValueError):
    """A config problem, as one line naming the field (bad input: exit 2 from any command)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _flags(value: Any) -> Any:
    """Extra flags by name: each value a scalar, a list of scalars, or null."""
    if not isinstance(value, dict):
        return value
    for k, v in value.items():
        if not (v is None or isinstance(v, (bool, int, float, str))
                or (isinstance(v, list) and all(isinstance(x, (bool, int, float, str)) for x in v))):
            raise ValueError(f"{k}: expected a scalar or a list of scalars, got {v!r}")
    return value


class ModelConfig(_Model):
    path: str
    num_layers: Count
    num_experts: Count
    topk: Count
    first_k_dense_replace: int = Field(0, ge=0)
    num_shared_experts: int = Field(0, ge=0)
    num_nextn_predict_layers: int = Field(0, ge=0)
    architecture: str = ""
    tokenizer_path: Optional[str] = None
    hidden_size: Optional[Count] = None
    num_attention_heads: Optional[Count] = None
    num_key_value_heads: Optional[Count] = None
    vocab_size: Optional[Count] = None
    build: Optional[Literal["tiny-glm45", "near-tie-glm45"]] = None
    seed: int = 0

    @model_validator(mode="after")
    def _layers(self):
        if self.topk > self.num_experts:
            raise ValueError(f"topk: {self.topk} exceeds model.num_experts {self.num_experts}")
        if self.first_k_dense_replace >= self.num_layers:
            raise ValueError(f"first_k_dense_replace: {self.first_k_dense_replace} leaves no MoE layer "
                             f"(num_layers {self.num_layers})")
        return self

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace


class ClusterConfig(_Model):
    nodes: Count = 1
    gpus_per_node: Count = 8
    device: Literal["cuda", "cpu"] = "cuda"

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class SpeculativeConfig(_Model):
    algorithm: Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"]
    num_steps: Count
    eagle_topk: Count
    num_draft_tokens: Count
    draft_model_path: Optional[str] = None


class EngineGroup(_Model):
    name: str
    engines: Count
    gpus_per_engine: Count
    tp: Count
    dp: Count = 1
    ep: Count = 1
    pp: Count = 1
    moe_dense_tp: Optional[Count] = None
    enable_dp_attention: bool = False
    enable_dp_lm_head: bool = False
    moe_a2a_backend: str = "none"
    speculative: Optional[SpeculativeConfig] = None
    routed_experts: bool = False
    chunked_prefill_size: Optional[int] = Field(None, ge=-1)
    max_running_requests: Optional[Count] = None
    cuda_graph_max_bs: Optional[Count] = None
    mem_fraction_static: Optional[float] = Field(None, ge=0.01, le=0.99)
    extra_sglang_args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    expected: dict[str, Any] = Field(default_factory=dict)

    @field_validator("extra_sglang_args", mode="before")
    @classmethod
    def _flag_values(cls, value):
        return _flags(value)

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value):
        """Environment values are strings; YAML scalars are taken as written (booleans as 1 / 0)."""
        if not isinstance(value, dict):
            return value
        out = {}
        for k, v in value.items():
            if not isinstance(v, (bool, int, float, str)):
                raise ValueError(f"{k}: expected a string, got {v!r}")
            out[k] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    @model_validator(mode="after")
    def _parallelism(self):
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.gpus_per_engine != self.tp * self.pp:
            raise ValueError(f"gpus_per_engine: {self.gpus_per_engine} != tp*pp = {self.tp * self.pp}")
        if self.tp % self.dp:
            raise ValueError(f"tp: tp {self.tp} is not divisible by dp {self.dp}")
        if self.tp % self.ep:
            raise ValueError(f"ep: tp {self.tp} is not divisible by ep {self.ep}")
        if self.dp > 1 and not self.enable_dp_attention:
            raise ValueError(f"dp: dp {self.dp} > 1 requires enable_dp_attention (slime asserts it)")
        if self.enable_dp_attention and self.dp < 2:
            raise ValueError(f"enable_dp_attention: needs dp >= 2, got dp {self.dp}")
        if self.enable_dp_lm_head and not self.enable_dp_attention:
            raise ValueError("enable_dp_lm_head: requires enable_dp_attention")
        if self.moe_dense_tp is not None and self.moe_dense_tp not in (1, self.tp):
            raise ValueError(f"moe_dense_tp: SGLang supports 1 or tp ({self.tp}), got {self.moe_dense_tp}")
        for k in self.extra_sglang_args:
            if k.startswith("-") or "-" in k:
                raise ValueError(f"extra_sglang_args.{k}: use the ServerArgs field name (underscores, no --)")
        return self

    @property
    def attn_dp_size(self) -> int:
        return self.dp if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        """SGLang 0.5.23: tp // attn_dp // attn_cp (attn_cp is 1 here)."""
        return self.tp // self.attn_dp_size


class SamplingConfig(_Model):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: Count = 1024


class ReadinessBudgets(_Model):
    """Seconds allowed per start-up phase (process alive -> HTTP up -> status Up ->
    /health_generate 200 -> one-token probe on every DP rank)."""
    process_s: float = Field(30.0, ge=0.1)
    http_s: float = Field(600.0, ge=0.1)
    server_up_s: float = Field(1800.0, ge=0.1)
    health_generate_s: float = Field(600.0, ge=0.1)
    dp_probe_s: float = Field(300.0, ge=0.1)
    @property
    def total_s(self) -> float:
        return self.process_s + self.http_s + self.server_up_s + self.health_generate_s + self.dp_probe_s


class HealthConfig(_Model):
    interval_s: float = Field(30.0, ge=0.1)
    timeout_s: float = Field(30.0, ge=0.1)
    failures: Count = 3


class RolloutConfig(_Model):
    batch_size: Count
    n_samples_per_prompt: Count
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    concurrency_per_engine: Count = 64
    host: str = "127.0.0.1"
    base_port: int = Field(30000, ge=BASE_PORTS[0], le=BASE_PORTS[1])
    api_key: Optional[str] = None
    engine_auth: Literal["key", "none"] = "key"
    allow_unauthenticated_network: bool = False
    allow_unfixed: bool = False
    restart_checkpoint: Optional[str] = None
    weight_update_pause: Optional[Literal["retract", "abort"]] = None
    partial_rollout: bool = True
    group_placement: Literal["group", "sample"] = "group"
    max_weight_version_lag: Optional[int] = Field(None, ge=0)
    stale_groups: Literal["regenerate", "drop"] = "regenerate"
    budgets: ReadinessBudgets = Field(default_factory=ReadinessBudgets)
    health: HealthConfig = Field(default_factory=HealthConfig)

    @model_validator(mode="after")
    def _keyless_network(self):
        problem = keyless_network_problem(self)
        if problem:
            raise ValueError(problem)
        return self


LOOPBACK = ("127.", "localhost", "::1")


def keyless_network_problem(r: "RolloutConfig") -> Optional[str]:
    """The one rule for keyless engines: loopback only, unless the config opts in explicitly."""
    if r.engine_auth != "none" or r.allow_unauthenticated_network or r.host.startswith(LOOPBACK):
        return None
    return (f"rollout.host {r.host!r} with engine_auth none: keyless engines reachable from the network (anyone "
            "can generate and load weights); use a loopback host, or set "
            "rollout.allow_unauthenticated_network: true for a private cluster interface")


class MegatronConfig(_Model):
    tp: Count = 1
    pp: Count = 1
    cp: Count = 1
    ep: Count = 1
    etp: Count = 1
    sequence_parallel: bool = False
    actor_num_nodes: Count = 1
    actor_num_gpus_per_node: Count = 8
    colocate: bool = True
    max_tokens_per_gpu: Optional[Count] = None
    use_dynamic_batch_size: bool = False
    extra_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("extra_args", mode="before")
    @classmethod
    def _flag_values(cls, value):
        return _flags(value)

    @model_validator(mode="after")
    def _parallelism(self):
        model_par = self.tp * self.pp * self.cp
        if self.world_size % model_par:
            raise ValueError(f"world size {self.world_size} is not divisible by tp*pp*cp = {model_par}")
        if (self.world_size // self.pp) % (self.ep * self.etp):
            raise ValueError(f"ep: ep*etp {self.ep * self.etp} does not divide the per-stage "
                             f"world size {self.world_size // self.pp}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel: needs tp > 1")
        return self

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node


class SlimeConfig(_Model):
    integration: Literal["plugin", "managed"] = "plugin"
    extra_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("extra_args", mode="before")
    @classmethod
    def _flag_values(cls, value):
        return _flags(value)


class TrainingConfig(_Model):
    model: ModelConfig
    engine_groups: list[EngineGroup]
    rollout: RolloutConfig
    name: str = ""
    description: str = ""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    megatron: Optional[MegatronConfig] = None
    slime: SlimeConfig = Field(default_factory=SlimeConfig)
    _source: str = PrivateAttr("")

    @property
    def source(self) -> str:
        """The file it was loaded from."""
        return self._source

    @source.setter
    def source(self, path: str) -> None:
        self._source = path

    def model_path(self, root: str = ".", build: Optional[Callable[..., str]] = None) -> str:
        """Absolute model path. When `model.build` names a builder, `build(name, path, seed=)` makes the
        checkpoint (the CLI passes `rollout.models.build`); without one an unbuilt model is a one-line error."""
        path = self.model.path
        local = path if os.path.isabs(path) else os.path.join(root, path)
        where = os.path.basename(self.source) if self.source else self.name
        if self.model.build and build:
            return build(self.model.build, local, seed=self.model.seed)
        if self.model.build and not os.path.isfile(os.path.join(local, "config.json")):
            raise ConfigError(f"{where}: model.path: {path!r} is not built yet (model.build {self.model.build}: "
                              f"slime-moe-rollout engine build-model --path {local})")
        if os.path.isdir(local):
            return os.path.abspath(local)
        if path.startswith((".", "/", "~")) or path.count("/") != 1:
            raise ConfigError(f"{where}: model.path: {path!r} does not exist (and model.build is not set)")
        return path  # "org/name": a hub id, SGLang resolves it

    def group(self, name: str) -> EngineGroup:
        for g in self.engine_groups:
            if g.name == name:
                return g
        raise KeyError(name)

    @model_validator(mode="after")
    def _weight_update_pause(self):
        """rollout.weight_update_pause reaches every engine as the plugin's switch (its environment variable)."""
        from sglang_patches.fixes.weight_update_pause import ENV

        mode = self.rollout.weight_update_pause
        for i, g in enumerate(self.engine_groups if mode else ()):
            if g.env.setdefault(ENV, mode) != mode:
                raise ValueError(f"engine_groups[{i}].env.{ENV}: {g.env[ENV]!r} contradicts "
                                 f"rollout.weight_update_pause {mode!r}")
        return self

    @model_validator(mode="after")
    def _fits(self):
        m, c = self.model, self.cluster
        if not self.engine_groups:
            raise ValueError("engine_groups: at least one engine group is required")
        seen = set()
        for i, g in enumerate(self.engine_groups):
            w = f"engine_groups[{i}]"
            if g.name in seen:
                raise ValueError(f"{w}.name: duplicate group name {g.name!r}")
            seen.add(g.name)
            if g.ep > m.num_experts or m.num_experts % g.ep:
                raise ValueError(f"{w}.ep: num_experts {m.num_experts} is not divisible by ep {g.ep}")
            if g.gpus_per_engine > c.gpus_per_node and g.gpus_per_engine % c.gpus_per_node:
                raise ValueError(f"{w}.gpus_per_engine: {g.gpus_per_engine} spans nodes but is not a multiple "
                                 f"of cluster.gpus_per_node {c.gpus_per_node}")
        used = sum(g.engines * g.gpus_per_engine for g in self.engine_groups)
        if used > c.total_gpus:
            raise ValueError(f"engine_groups: {used} GPUs requested but cluster has "
                             f"{c.nodes}x{c.gpus_per_node} = {c.total_gpus}")
        mg = self.megatron
        if mg is not None:
            if mg.world_size > c.total_gpus:
                raise ValueError(f"megatron: {mg.world_size} actor GPUs exceed the cluster's {c.total_gpus}")
            if m.num_experts % mg.ep:
                raise ValueError(f"megatron.ep: num_experts {m.num_experts} is not divisible by ep {mg.ep}")
            if not mg.colocate and used + mg.world_size > c.total_gpus:
                raise ValueError(f"megatron.colocate: false needs {mg.world_size} + {used} GPUs, cluster has "
                                 f"{c.total_gpus}")
        return self


# ---------------------------------------------------------------- pydantic's first error as one line

_TYPES = {"int": "an integer", "float": "a number", "bool": "true/false", "string": "a string",
          "dict": "a mapping", "model": "a mapping", "list": "a list"}


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(loc: tuple) -> list:
    """Field names of the model at `loc` (empty where `loc` is no model)."""
    model = TrainingConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if part not in model.model_fields:
            return []
        ann = model.model_fields[part].annotation
        inner = [a for a in (getattr(ann, "__args__", None) or (ann,)) if isinstance(a, type)]
        model = next((a for a in inner if issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


def one_line(err: ValidationError) -> str:
    """The first problem pydantic found, as `<field path>: <problem>`."""
    e = err.errors()[0]
    loc, kind, value, ctx = tuple(e["loc"]), e["type"], e.get("input"), e.get("ctx") or {}
    where = _where(loc)
    if kind == "value_error":  # a rule declared on a model; its text starts with the field it is about
        text = str(ctx.get("error", e["msg"]))
        field, fields = text.split(":")[0].split(".")[0].split("[")[0], _fields_at(loc)
        if not where:
            return text
        return f"{where}.{text}" if field in fields or not fields else f"{where}: {text}"
    if kind == "missing":
        text = "missing required field"
    elif kind == "extra_forbidden":
        text = f"unknown field (allowed: {', '.join(_fields_at(loc[:-1]))})"
    elif kind == "literal_error":
        text = f"{value!r} is not one of {ctx['expected']}"
    elif kind in ("greater_than_equal", "greater_than"):
        text = f"must be >= {ctx.get('ge', ctx.get('gt'))}, got {value!r}"
    elif kind in ("less_than_equal", "less_than"):
        text = f"must be <= {ctx.get('le', ctx.get('lt'))}, got {value!r}"
    elif kind.endswith("_type") or kind.endswith("_parsing"):
        text = f"expected {_TYPES.get(kind.split('_')[0], kind)}, got {value!r}"
    else:
        text = f"{e['msg']}, got {value!r}"
    return f"{where or 'top level'}: {text}"


def json_schema() -> dict:
    """The JSON schema of a config file (for editors: `slime-moe-rollout config schema`)."""
    return TrainingConfig.model_json_schema()


# ---------------------------------------------------------------- entry points

def parse_config(data, name: str = "") -> TrainingConfig:
    """Build and structurally check a config from already-parsed YAML data."""
    if not isinstance(data, dict):
        raise ConfigError(f"top level: expected a mapping, got {data!r}")
    try:
        cfg = TrainingConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(one_line(e)) from None
    if not cfg.name:
        cfg.name = name
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
