"""The trainer-side replay of the engine benchmarks that span weight updates (r3_retraction.py,
fully_async_update.py): each response token's logprob recomputed by transformers under the weights of the version
that sampled it, with the sample's one routed-experts array replayed, against the engine's logprob.

A sample is a `Replayed` (prompt and response ids, the engine's logprobs, the compact rows
`[len(tokens) - 1, moe_layers, topk]`, and its weight-version spans over the response, `[{"version", "start",
"end"}, ...]`). `lm_for(version)` gives the trainer's model of a version (one checkpoint for every version:
`lambda v: lm`); each distinct model runs one forward per sample. Tokens in no span get `lm_for(None)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Replayed:
    prompt_ids: list
    response_ids: list
    logprobs: list
    routed_experts: np.ndarray
    spans: list

    @property
    def spans_update(self) -> bool:
        """Its tokens were sampled by more than one weight version."""
        return len({s["version"] for s in self.spans}) > 1


def spans_from_meta(meta: dict, n: int) -> list:
    """A sample's spans from its last SGLang answer (`meta_info["weight_versions"]`, 0.5.19+), else one span of
    `meta_info["weight_version"]`."""
    spans = [{"version": str(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
             for s in meta.get("weight_versions") or ()]
    return spans or [{"version": meta.get("weight_version"), "start": 0, "end": n}]


def trainer_logprobs(lm_for, s: Replayed) -> tuple:
    """(logprob of every response token under its version's weights, the routing of the last forward)."""
    from rollout.r3.replay import recompute

    n = len(s.response_ids)
    version_of = [None] * n
    for sp in s.spans:
        for i in range(max(0, sp["start"]), min(n, sp["end"])):
            version_of[i] = sp["version"]
    out, used, done = np.zeros(n), None, {}
    for i, v in enumerate(version_of):
        lm = lm_for(v)
        if id(lm) not in done:
            r = recompute(lm, s.prompt_ids, s.response_ids, s.routed_experts)
            done[id(lm)], used = r.logprobs, r.routing
        out[i] = done[id(lm)][i]
    return out, used


def pooled(lm_for, samples: list):
    """One `rollout.r3.metrics.Mismatch` over `samples` (k3 KL, mean |d|, routing flips vs the captured rows)."""
    from rollout.r3.metrics import mismatch

    lps, used = zip(*(trainer_logprobs(lm_for, s) for s in samples))
    return mismatch(list(lps), [s.logprobs for s in samples], list(used),
                    [np.asarray(s.routed_experts, np.int64) for s in samples])


def split_at_first_change(lm_for, samples: list) -> dict:
    """k3 KL / mean |d| over the response tokens before each sample's first weight-version change and after it
    (samples of one version left out)."""
    from rollout.r3.metrics import logprob_stats

    parts = {"before": ([], []), "after": ([], [])}
    for s in samples:
        changes = [sp["start"] for a, sp in zip(s.spans, s.spans[1:]) if sp["version"] != a["version"]]
        if not changes:
            continue
        trainer, _ = trainer_logprobs(lm_for, s)
        for part, sl in (("before", slice(0, changes[0])), ("after", slice(changes[0], None))):
            parts[part][0].extend(trainer[sl])
            parts[part][1].extend(s.logprobs[sl])
    return {part: logprob_stats(t, r) for part, (t, r) in parts.items() if t}


def ratio(a, b) -> float:
    """k3 KL of `a` / of `b` (Mismatch); inf where `b` has none."""
    return a.k3_kl / b.k3_kl if b.k3_kl > 0 else float("inf")
