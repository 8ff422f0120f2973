"""`r3 check`: what routing replay buys, measured on real engines.

1. Prompts go through the rollout manager to SGLang engines (started from a training config, or
   attached at a URL) with logprobs and routed experts on; each finished sample carries its response
   tokens, the engine's logprob of each, and the captured routing (compact, one row per token).
2. The trainer side recomputes the same response tokens' logprobs with transformers' GLM-4.5 forward,
   in the engine's dtype: (a) with its own routing, (b) with the captured routing replayed.
3. One table compares rollout logprob vs trainer recompute (d = trainer - rollout, the same token) for
   both arms, with the routing flip rates of the trainer forward against the captured routing.

`corrupt` replays deliberately wrong rows instead ("shift": every row moved down one token; "swap":
another sample's rows), which must not reduce the mismatch: the check then fails, as it should.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from rollout.r3.metrics import Mismatch, mismatch
from rollout.r3.replay import load_model, recompute
from rollout.types import SampleStatus

PAIR = ("rollout logprob (SGLang output_token_logprobs of each response token) vs trainer recompute "
        "(transformers Glm4MoeForCausalLM forward over prompt + response, same tokens); d = trainer - rollout")
CORRUPTIONS = ("shift", "swap")


@dataclass
class RolloutSample:
    prompt_ids: list
    response_ids: list
    logprobs: list            # the engine's, one per response token
    routed_experts: np.ndarray  # compact [len(tokens) - 1, moe_layers, topk]

    def as_dict(self) -> dict:
        return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "logprobs": [float(x) for x in self.logprobs], "routed_experts": self.routed_experts.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutSample":
        return cls(d["prompt_ids"], d["response_ids"], d["logprobs"], np.asarray(d["routed_experts"], np.int64))


@dataclass
class Report:
    own: Mismatch
    replay: Mismatch
    corrupt: Optional[str] = None
    samples: int = 0
    dtype: str = ""
    notes: list = field(default_factory=list)

    @property
    def replay_reduces(self) -> bool:
        return self.replay.k3_kl < self.own.k3_kl and self.replay.mean_abs_diff < self.own.mean_abs_diff

    def ratios(self) -> dict:
        def r(a, b):
            return float(a / b) if b > 0 else float("inf")
        return {"k3_kl": r(self.own.k3_kl, self.replay.k3_kl),
                "mean_abs_diff": r(self.own.mean_abs_diff, self.replay.mean_abs_diff)}

    def as_dict(self) -> dict:
        return {"pair": PAIR, "samples": self.samples, "dtype": self.dtype, "corrupt": self.corrupt,
                "own_routing": self.own.as_dict(), "replayed_routing": self.replay.as_dict(),
                "reduction": self.ratios(), "replay_reduces_mismatch": self.replay_reduces, "notes": self.notes}


def corrupted(rows: list, how: str) -> list:
    """Valid-looking but wrong routing: `shift` moves every row down one token (row i gets row i-1,
    row 0 keeps its own); `swap` gives sample k the rows of sample k+1 (cycled or cut to its length)."""
    if how == "shift":
        return [np.concatenate([r[:1], r[:-1]]) if len(r) > 1 else r for r in rows]
    if how == "swap":
        if len(rows) < 2:
            raise ValueError("corrupt=swap needs at least 2 samples")
        out = []
        for k, r in enumerate(rows):
            other = rows[(k + 1) % len(rows)]
            idx = np.arange(len(r)) % len(other)
            out.append(other[idx])
        return out
    raise ValueError(f"unknown corruption {how!r} (choose from {', '.join(CORRUPTIONS)})")


def arm(model, samples: list, rows: Optional[list] = None) -> Mismatch:
    """One arm: the trainer forward with its own routing (`rows` None) or `rows` replayed, per sample;
    flips are counted against the engine's captured routing."""
    captured = [np.asarray(s.routed_experts, np.int64) for s in samples]
    lps, used = [], []
    for s, r in zip(samples, rows if rows is not None else [None] * len(samples)):
        out = recompute(model, s.prompt_ids, s.response_ids, r)
        lps.append(out.logprobs)
        used.append(out.routing)
    return mismatch(lps, [s.logprobs for s in samples], used, captured)


def evaluate(model, samples: list, corrupt: Optional[str] = None, own: Optional[Mismatch] = None) -> Report:
    """Both arms on `samples` (RolloutSample): (a) own routing (or the given `own`), (b) replayed."""
    captured = [np.asarray(s.routed_experts, np.int64) for s in samples]
    replayed = arm(model, samples, corrupted(captured, corrupt) if corrupt else captured)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return Report(own or arm(model, samples), replayed, corrupt, len(samples), dtype)


class _Sink:
    def __init__(self):
        self.groups = []

    async def put(self, group) -> bool:
        self.groups.append(group)
        return True


def to_samples(groups) -> tuple:
    """Finished manager groups -> (RolloutSamples, notes about the samples left out)."""
    out, notes = [], []
    for g in groups:
        for s in g.samples:
            if not SampleStatus(s.status).finished or s.routed_experts is None or not s.response_ids:
                notes.append(f"{s.sample_id}: left out ({s.error or s.status})")
                continue
            if len(s.logprobs) != len(s.response_ids):
                notes.append(f"{s.sample_id}: left out ({len(s.logprobs)} logprobs for {len(s.response_ids)} tokens)")
                continue
            out.append(RolloutSample(list(s.prompt_ids), list(s.response_ids), list(s.logprobs),
                                     np.asarray(s.routed_experts, np.int64)))
    return out, notes


async def _rollout(mgr, prompts) -> list:
    sink = _Sink()
    async with mgr:
        await mgr.rollout(prompts, sink, batch_size=len(prompts))
    return sink.groups


def rollout_from_config(cfg, model_path: str, prompts: list, backend, view=None) -> tuple:
    """Start the config's engines (through the manager), roll `prompts` out, stop them."""
    from rollout.net import free_port
    from rollout.manager import RolloutManager

    if not any(g.routed_experts for g in cfg.engine_groups):
        raise ValueError("the config's engines do not capture routed experts (engine_groups[].routed_experts)")
    ports = [free_port(cfg.rollout.host) for _ in range(sum(g.engines for g in cfg.engine_groups))]
    mgr = RolloutManager.from_config(cfg, backend, model_path, view=view, ports=ports)
    return to_samples(asyncio.run(_rollout(mgr, prompts)))


def rollout_from_url(url: str, model_path: str, prompts: list, sampling: dict, n_samples: int = 1,
                     api_key: Optional[str] = None) -> tuple:
    """Attach the manager to a running engine at `url` (routed-expert capture must be on there)."""
    import json
    import os

    from rollout.manager import RolloutManager, RolloutOptions, engine_source
    from rollout.routed_experts import MoELayout
    from rollout.types import Endpoint

    with open(os.path.join(model_path, "config.json")) as f:
        layout = MoELayout.from_hf_config(json.load(f))
    source = engine_source(endpoints=[Endpoint("url-0", url.rstrip("/"), api_key)])
    mgr = RolloutManager(source, RolloutOptions(sampling, n_samples, concurrency=8, layout=layout))
    return to_samples(asyncio.run(_rollout(mgr, prompts)))


def run(samples: list, model_path: str, dtype: str, corrupt: Optional[str] = None, notes=()) -> Report:
    if not samples:
        raise ValueError("no sample came back with response tokens, logprobs and routed experts")
    rep = evaluate(load_model(model_path, dtype), samples, corrupt)
    rep.notes = list(notes)
    return rep


def table(rep: Report) -> str:
    """The one table, plain text."""
    rows = [("k3 KL  mean(exp(d)-1-d)", "k3_kl", "{:.3g}"), ("mean |d|", "mean_abs_diff", "{:.3g}"),
            ("|d| > ln 2", "extreme_frac_ln2", "{:.2%}"), ("|d| > ln 5", "extreme_frac_ln5", "{:.2%}"),
            ("routing flip rate (token-layers)", "flip_rate", "{:.2%}"),
            ("tokens with any flip", "tokens_any_flip", "{:.2%}")]
    b = "replayed" + (f" ({rep.corrupt}-corrupted rows)" if rep.corrupt else "")
    w = max(16, len(b) + 4)
    lines = [f"R3 check: {rep.samples} samples, {rep.own.tokens} response tokens, trainer dtype {rep.dtype}",
             f"compares: {PAIR}",
             "flips: the trainer forward's expert set vs the engine's captured set, per token row and MoE layer",
             f"{'metric':34} {'(a) own routing':>16} {'(b) ' + b:>{w}}"]
    for label, key, fmt in rows:
        lines.append(f"{label:34} {fmt.format(getattr(rep.own, key)):>16} {fmt.format(getattr(rep.replay, key)):>{w}}")
    for j, (a, r) in enumerate(zip(rep.own.flip_rate_per_layer, rep.replay.flip_rate_per_layer)):
        lines.append(f"{'  flip rate, MoE layer ' + str(j):34} {a:>16.2%} {r:>{w}.2%}")
    ratio = rep.ratios()
    lines.append(f"(a) / (b): k3 KL {ratio['k3_kl']:.3g}x, mean |d| {ratio['mean_abs_diff']:.3g}x "
                 "(above 1: replay lowers the mismatch)")
    lines += [f"note: {n}" for n in rep.notes]
    if rep.replay_reduces:
        lines.append("verdict: replay reduces the mismatch")
    else:
        lines.append("verdict: FAIL: replay does not reduce the mismatch (k3 KL and mean |d| must both drop)"
                     + (f"; the replayed rows were {rep.corrupt}-corrupted" if rep.corrupt else
                        "; are the routed experts the rollout's own, row for row?"))
    return "\n".join(lines)
