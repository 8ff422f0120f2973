"""What SGLang derives from an engine group's flags: attn_tp_size and the DP-attention gathers.

`sglang_derive` asks the installed SGLang itself: it parses the rendered flags with
`ServerArgs.add_cli_args`, builds `ServerArgs.from_cli_args`, runs SGLang's resolution pipeline in a
private runtime context (`runtime_context.create_context`, no GPU and no process group needed;
`--device cuda` is assumed for GPU configs so the platform check passes on a CPU host), seeds the MoE
flags with SGLang's `initialize_moe_config`, and then calls `require_mlp_tp_gather`,
`require_attn_tp_gather` and `require_gathered_buffer` inside that context.
The model's HF config comes from `model.path` when it is a local directory, otherwise a config.json
is written from the facts in the YAML (no weights, no hub access).

`our_derive` is the same rule set re-derived by hand (SGLang 0.5.23 `srt/utils/common.py` and
`runtime_context.py`); `tests/test_config_derive.py` compares the two on a grid of configurations.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field

from sglang_patches.registry import sglang_version
from training_configs.schema import ConfigError, EngineGroup, TrainingConfig
from training_configs.server_args import fields_to_flags, server_fields

# a2a backends for which SGLang 0.5.23 requires the MLP TP gather for DP-count bookkeeping
_MLP_GATHER_A2A = ("none", "flashinfer", "mori_epv2", "flashinfer_megamoe")
_MODEL_TYPES = {"Glm4MoeForCausalLM": "glm4_moe"}


@dataclass
class Derived:
    attn_tp_size: int
    attn_dp_size: int
    num_dp_ranks: int
    require_mlp_tp_gather: bool
    require_attn_tp_gather: bool
    source: str                               # "sglang X.Y.Z" or "ours"
    resolved: dict = field(default_factory=dict)   # SGLang's resolved fields (sglang_derive only)
    notes: list = field(default_factory=list)      # SGLang's own warnings during resolution

    @property
    def require_gathered_buffer(self) -> bool:
        return self.require_mlp_tp_gather or self.require_attn_tp_gather

    def facts(self) -> dict:
        return {"attn_tp_size": self.attn_tp_size, "attn_dp_size": self.attn_dp_size,
                "num_dp_ranks": self.num_dp_ranks, "require_mlp_tp_gather": self.require_mlp_tp_gather,
                "require_attn_tp_gather": self.require_attn_tp_gather,
                "require_gathered_buffer": self.require_gathered_buffer}


def our_derive(g: EngineGroup, disable_attn_tp_gather: bool = False) -> Derived:
    """SGLang 0.5.23's rules, by hand: --dp-size N --enable-dp-attention becomes attn_dp_size N, dp_size 1."""
    attn_dp = g.dp if g.enable_dp_attention else 1
    dp = 1 if g.enable_dp_attention else g.dp
    num_dp_ranks = dp * attn_dp
    attn_tp = g.tp // attn_dp
    a2a = g.moe_a2a_backend
    attn_dp_on = attn_dp > 1
    if not attn_dp_on:
        mlp = False
    elif g.moe_dense_tp is None or not g.enable_dp_lm_head or a2a in _MLP_GATHER_A2A:
        mlp = True
    elif a2a == "mori" and os.environ.get("SGLANG_MORI_RECV_BOUND", "").lower() in ("1", "true", "yes"):
        mlp = True
    else:
        mlp = g.moe_dense_tp > g.tp // num_dp_ranks
    if disable_attn_tp_gather:
        attn = False
    elif a2a != "none" or g.moe_dense_tp is not None:
        attn = num_dp_ranks < g.tp if attn_dp_on else True
    else:
        attn = False
    return Derived(attn_tp, attn_dp, num_dp_ranks, mlp, attn, "ours")


# ---------------------------------------------------------------- SGLang's own answer

_PARSER = None


def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's own CLI parser (ServerArgs.add_cli_args); errors raise instead of exiting."""
    global _PARSER
    if _PARSER is None:
        from sglang.srt.server_args import ServerArgs

        class _Raising(argparse.ArgumentParser):
            def error(self, message):
                raise ConfigError(f"SGLang's parser rejects the rendered flags: {message}")

        p = _Raising(prog="sglang", add_help=False)
        ServerArgs.add_cli_args(p)
        _PARSER = p
    return _PARSER


def parse_sglang_flags(flags: list[str]) -> argparse.Namespace:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return sglang_parser().parse_args(flags)


def _hf_config(cfg: TrainingConfig) -> dict:
    m = cfg.model
    arch = m.architecture or "Glm4MoeForCausalLM"
    if arch not in _MODEL_TYPES:
        raise ConfigError(f"model.path: {m.path!r} is not a local directory and no HF config can be "
                          f"synthesized for architecture {arch!r} (known: {', '.join(_MODEL_TYPES)})")
    heads = m.num_attention_heads or 8
    hidden = m.hidden_size or 64 * heads
    return {
        "architectures": [arch], "model_type": _MODEL_TYPES[arch],
        "num_hidden_layers": m.num_layers, "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.topk, "first_k_dense_replace": m.first_k_dense_replace,
        "n_shared_experts": m.num_shared_experts, "num_nextn_predict_layers": m.num_nextn_predict_layers,
        "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": m.num_key_value_heads or heads, "head_dim": hidden // heads,
        "vocab_size": m.vocab_size or 32000, "intermediate_size": 4 * hidden,
        "moe_intermediate_size": hidden, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    }


@contextlib.contextmanager
def _model_dir(cfg: TrainingConfig):
    path = cfg.model.path
    local = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    if os.path.isfile(os.path.join(local, "config.json")):
        yield local
        return
    with tempfile.TemporaryDirectory(prefix="smr-hfcfg-") as d:
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump(_hf_config(cfg), fh)
        yield d


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage().splitlines()[0] if record.getMessage() else record.levelname)


@contextlib.contextmanager
def _quiet():
    root = logging.getLogger()
    saved = root.handlers[:]
    cap = _Capture()
    root.handlers = [cap]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield cap
    finally:
        root.handlers = saved


def _where(exc: BaseException) -> str:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    code = last.tb_frame.f_code
    fname = code.co_filename.split("site-packages/")[-1]
    return f" (at {fname}:{last.tb_lineno} in {code.co_name})"


def sglang_derive(cfg: TrainingConfig, group: EngineGroup) -> Derived:
    """Evaluate SGLang's own rules for `group`; raises ConfigError if SGLang rejects the flags."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import require_attn_tp_gather, require_mlp_tp_gather

    with _model_dir(cfg) as model_dir:
        fields = server_fields(cfg, group, model_path=model_dir)
        fields.setdefault("device", "cpu" if cfg.cluster.device == "cpu" else "cuda")
        flags = fields_to_flags(fields)
        ns = parse_sglang_flags(flags)
        sa = ServerArgs.from_cli_args(ns)
        with _quiet() as cap:
            try:
                ctx = rc.create_context(sa, role="scheduler")
            except ConfigError:
                raise
            except BaseException as e:  # SGLang's own validation: report it on one line
                msg = " ".join(str(e).split()) or type(e).__name__
                raise ConfigError(f"SGLang {sglang_version()} rejects engine group {group.name!r}: "
                                  f"{msg}{_where(e)}") from None
        with rc.use_context(ctx):
            initialize_moe_config()
            par = rc.get_parallel()
            derived = Derived(
                attn_tp_size=int(par.attn_tp_size), attn_dp_size=int(par.attn_dp_size),
                num_dp_ranks=int(par.num_dp_ranks),
                require_mlp_tp_gather=bool(require_mlp_tp_gather()),
                require_attn_tp_gather=bool(require_attn_tp_gather()),
                source=f"sglang {sglang_version()}",
            )
        resolved = sa.resolved_dict()
    resolved["model_path"] = cfg.model.path
    if resolved.get("speculative_draft_model_path") == model_dir:
        resolved["speculative_draft_model_path"] = cfg.model.path
    derived.resolved = resolved
    derived.notes = [n for n in cap.lines if n]
    return derived
