"""`config check`: everything that can be known about a config before GPUs are reserved.

Order: schema + structure (`schema.load_config`), our own checks (EAGLE constraints, attention heads,
ports, extra SGLang args), then SGLang's own derivation (`derive.sglang_derive`, which also runs
SGLang's argument validation), the comparison with the values the config states (`expected`), and
the fixes this configuration needs (`sglang_patches.status.fixes_for_config`: `Verdict`s).
An error raises ConfigError (one line); warnings and facts are collected in a `Report`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sglang_patches.errors import CliError
from sglang_patches.fixes.accepted_path_rows import tree_drafts
from sglang_patches.registry import sglang_version
from sglang_patches.status import fixes_for_config
from training_configs.derive import Derived, our_derive, sglang_derive
from training_configs.replay_check import mtp_replay
from training_configs.schema import ConfigError, EngineGroup, TrainingConfig, keyless_network_problem, load_config
from training_configs.server_args import PORTS_PER_ENGINE, engine_port, server_fields
from training_configs.slime_check import managed_checks

EXPECTABLE = ("attn_tp_size", "attn_dp_size", "num_dp_ranks", "require_mlp_tp_gather",
              "require_attn_tp_gather", "require_gathered_buffer")
_A2A_ALTERNATIVES = ("none", "deepep", "flashinfer", "mooncake")


@dataclass
class GroupReport:
    name: str
    derived: Derived
    fixes: list = field(default_factory=list)   # sglang_patches.registry.Verdict, `needed` set
    server_args: dict = field(default_factory=dict)


@dataclass
class Report:
    config: TrainingConfig
    groups: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "config": self.config.name, "source": self.config.source, "ok": True,
            "warnings": self.warnings, "notes": self.notes,
            "groups": [{"name": g.name, "derived_by": g.derived.source, **g.derived.facts(),
                        "fixes": [v.as_dict() for v in g.fixes]} for g in self.groups],
        }


def _speculative_checks(cfg: TrainingConfig, g: EngineGroup, w: str) -> None:
    s = g.speculative
    if s is None:
        return
    w = f"{w}.speculative"
    if s.num_draft_tokens < 2:
        raise ConfigError(f"{w}.num_draft_tokens: must be >= 2, got {s.num_draft_tokens}")
    if s.eagle_topk == 1 and s.num_draft_tokens != s.num_steps + 1:
        raise ConfigError(f"{w}.num_draft_tokens: with eagle_topk 1 SGLang uses num_steps+1 = "
                          f"{s.num_steps + 1}, got {s.num_draft_tokens}")
    tree = 1 + s.eagle_topk + (s.num_steps - 1) * s.eagle_topk * s.eagle_topk
    if s.num_draft_tokens > tree:
        raise ConfigError(f"{w}.num_draft_tokens: {s.num_draft_tokens} exceeds the draft tree of "
                          f"{s.num_steps} steps x top-{s.eagle_topk} ({tree} tokens incl. the root)")
    if s.algorithm in ("EAGLE", "NEXTN") and not s.draft_model_path and cfg.model.num_nextn_predict_layers < 1:
        raise ConfigError(f"{w}.draft_model_path: {s.algorithm} without a draft model needs MTP layers, "
                          "but model.num_nextn_predict_layers is 0")
    if s.algorithm in ("EAGLE3", "STANDALONE") and not s.draft_model_path:
        raise ConfigError(f"{w}.draft_model_path: {s.algorithm} needs a draft model path")
    if s.algorithm == "STANDALONE" and g.enable_dp_attention:
        raise ConfigError(f"{w}.algorithm: SGLang's STANDALONE speculative decoding does not support DP attention")


def _accepted_path_rows(cfg: TrainingConfig, g: EngineGroup, w: str) -> None:
    """Routed experts with a speculative tree (EAGLE top-k > 1, ngram), however the flags are given (typed or
    extra_sglang_args): SGLang's capture rows do not follow the accepted draft path (sglang#37949); the
    plugin refuses it in the engine too."""
    f = server_fields(cfg, g)
    algorithm, topk = f.get("speculative_algorithm"), f.get("speculative_eagle_topk")
    if not (f.get("enable_return_routed_experts") and tree_drafts(algorithm, topk)):
        return
    if int(topk or 1) > 1:
        field, value = ("extra_sglang_args.speculative_eagle_topk" if "speculative_eagle_topk" in g.extra_sglang_args
                        else "speculative.eagle_topk"), topk
    else:
        field, value = "extra_sglang_args.speculative_algorithm", algorithm
    raise ConfigError(f"{w}.{field}: {value} with routed experts: SGLang's capture rows do not follow the accepted "
                      "draft path of a tree or ngram draft (sglang#37949); use EAGLE with eagle_topk 1")


def _group_checks(cfg: TrainingConfig, g: EngineGroup, i: int) -> None:
    w = f"engine_groups[{i}]"
    heads = cfg.model.num_attention_heads
    if heads and heads % g.attn_tp_size:
        raise ConfigError(f"{w}: num_attention_heads {heads} is not divisible by attn_tp_size {g.attn_tp_size} "
                          f"(tp {g.tp} / attention dp {g.attn_dp_size})")
    if g.routed_experts and g.pp > 1:
        raise ConfigError(f"{w}.routed_experts: routed-expert capture with pp > 1 returns per-stage layers; "
                          "use pp 1")
    if g.moe_a2a_backend.startswith("deepep") and g.ep != g.tp:
        raise ConfigError(f"{w}.moe_a2a_backend: {g.moe_a2a_backend} needs ep == tp ({g.tp}), got ep {g.ep}")
    if g.moe_a2a_backend != "none" and g.ep == 1:
        raise ConfigError(f"{w}.moe_a2a_backend: {g.moe_a2a_backend!r} needs expert parallelism (ep > 1)")
    _speculative_checks(cfg, g, w)
    _accepted_path_rows(cfg, g, w)
    for key in g.expected:
        if key not in EXPECTABLE:
            raise ConfigError(f"{w}.expected.{key}: unknown fact (known: {', '.join(EXPECTABLE)})")
    if cfg.cluster.device == "cpu" and g.extra_sglang_args.get("device", "cpu") != "cpu":
        raise ConfigError(f"{w}.extra_sglang_args.device: cluster.device is cpu")


def static_checks(cfg: TrainingConfig) -> None:
    """Checks that need no SGLang import."""
    total = sum(g.engines for g in cfg.engine_groups)
    if engine_port(cfg.rollout.base_port, total) > 65535:
        raise ConfigError(f"rollout.base_port: {cfg.rollout.base_port} + {PORTS_PER_ENGINE} x {total} engines "
                          "exceeds port 65535")
    for i, g in enumerate(cfg.engine_groups):
        _group_checks(cfg, g, i)
    r = cfg.rollout
    if keyless_network_problem(r):      # also caught at load; here for configs changed after loading
        raise ConfigError(keyless_network_problem(r))
    if r.health.timeout_s > r.health.interval_s * r.health.failures * 10:
        raise ConfigError("rollout.health.timeout_s: longer than 10 x interval_s x failures")


def _compare_expected(g: EngineGroup, d: Derived, warnings: list) -> None:
    facts = d.facts()
    for key, stated in g.expected.items():
        if facts[key] == stated:
            continue
        msg = f"group {g.name}: the config states {key} = {stated}, but {d.source} derives {facts[key]}"
        if key == "require_mlp_tp_gather":
            alts = []
            for a2a in _A2A_ALTERNATIVES:
                if a2a == g.moe_a2a_backend or (a2a != "none" and g.ep == 1):
                    continue
                probe = g.model_copy(update={"moe_a2a_backend": a2a})
                if our_derive(probe).require_mlp_tp_gather == stated:
                    alts.append(a2a)
            msg += f" with moe_a2a_backend {g.moe_a2a_backend!r}"
            if alts:
                msg += f" ({stated} needs moe_a2a_backend {' or '.join(repr(a) for a in alts)})"
        warnings.append(msg)


def _fix_args(cfg: TrainingConfig, g: EngineGroup, d: Derived) -> dict:
    """The dict handed to fixes_for_config: the fields as launched (dp_size = DP-attention width),
    SGLang's resolved value for every field left unset, plus the derived facts."""
    args = dict(server_fields(cfg, g))
    for key, value in d.resolved.items():
        if args.get(key) is None:
            args[key] = value
    args.update(d.facts())
    return args


def _fixes(args: dict, warnings: list, gname: str) -> list:
    verdicts = fixes_for_config(args)
    for v in verdicts:
        if not v.satisfied:
            warnings.append(f"group {gname}: needs fix {v.fix.name}, which is {v.state.value} here: {v.reason}")
    return verdicts


def check_config(cfg: TrainingConfig, use_sglang: bool = True) -> Report:
    static_checks(cfg)
    report = Report(cfg)
    if cfg.slime.integration == "managed":
        report.warnings += managed_checks(cfg)
    notes, warnings = mtp_replay(cfg)
    report.notes += notes
    report.warnings += warnings
    if use_sglang and sglang_version() is None:
        raise CliError("SGLang is not installed here: install the release the engines run (pip install sglang==...) "
                       "or check with our copy of SGLang 0.5.23's rules: config check --no-sglang")
    for g in cfg.engine_groups:
        if use_sglang:
            d = sglang_derive(cfg, g)
            ours = our_derive(g)
            if ours.facts() != d.facts():
                report.warnings.append(f"group {g.name}: our rule copy disagrees with {d.source}: "
                                       f"{ours.facts()} vs {d.facts()} (SGLang's answer is used)")
            report.notes += [f"group {g.name}: sglang: {n}" for n in d.notes]
        else:
            d = our_derive(g)
        _compare_expected(g, d, report.warnings)
        args = _fix_args(cfg, g, d)
        report.groups.append(GroupReport(g.name, d, _fixes(args, report.warnings, g.name), args))
    return report


def check_file(path, use_sglang: bool = True) -> Report:
    return check_config(load_config(path), use_sglang=use_sglang)


def format_report(rep: Report) -> str:
    cfg = rep.config
    lines = [f"{cfg.name}: OK ({len(cfg.engine_groups)} engine group(s), "
             f"{sum(g.engines * g.gpus_per_engine for g in cfg.engine_groups)} rollout GPUs, "
             f"integration {cfg.slime.integration})"]
    for gr in rep.groups:
        g = cfg.group(gr.name)
        d = gr.derived
        spec = (f", {g.speculative.algorithm} {g.speculative.num_steps}/{g.speculative.eagle_topk}/"
                f"{g.speculative.num_draft_tokens}" if g.speculative else "")
        lines.append(f"group {g.name}: {g.engines} x tp {g.tp} dp {g.dp} ep {g.ep} dense-tp {g.moe_dense_tp} "
                     f"a2a {g.moe_a2a_backend}{spec}{', routed experts' if g.routed_experts else ''}")
        lines.append(f"  derived by {d.source}: attn_tp_size {d.attn_tp_size}, attn_dp_size {d.attn_dp_size}, "
                     f"require_mlp_tp_gather {d.require_mlp_tp_gather}, require_attn_tp_gather "
                     f"{d.require_attn_tp_gather}, require_gathered_buffer {d.require_gathered_buffer}")
        for v in gr.fixes:
            lines.append(f"  fix {v.fix.name:<28} {'needed' if v.needed else 'not needed':<10} {v.state.value}")
    lines += [f"warning: {w}" for w in rep.warnings]
    lines += [f"note: {n}" for n in rep.notes]
    return "\n".join(lines)
