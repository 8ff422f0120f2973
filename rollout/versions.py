"""The weight version of every response token: one builder for every consumer (`run`'s rows, `serve`'s groups,
slime's samples in plugin and fully-async mode).

The dispatcher notes each answer (`note`): its tokens get SGLang's own spans (`meta_info["weight_versions"]`,
0.5.19+: which tokens of one answer each version sampled when the request lived across a weight update), else
the answer's one `weight_version`. `version_spans` gives a sample's `[{"version", "start", "end"}, ...]` over its
whole response (tokens it held before any answer, e.g. from slime's buffer, get `held_version`). `Versions`
orders versions for a staleness bound: integers as such (slime numbers its updates), others as first seen;
`StaleGate` applies that bound in front of `run`'s and `serve`'s consumers.
"""
from __future__ import annotations

import math
from typing import Optional

from rollout.types import Group


def add(spans: list, version, n: int) -> None:
    """`n` more tokens of `version` at the end of `spans` (merged with the last span of the same version)."""
    if n <= 0:
        return
    if spans and spans[-1]["version"] == version:
        spans[-1]["end"] += n
    else:
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": start + n})


def note(sample, n: int, meta: dict) -> None:
    """Answer `meta` gave `sample` `n` more response tokens: their versions on `sample.weight_version_spans`,
    the answer's final version on `sample.weight_versions`."""
    done = 0
    for span in meta.get("weight_versions") or ():
        k = min(int(span["end"]), n) - done
        add(sample.weight_version_spans, str(span["version"]), k)
        done += max(0, k)
    version = None if meta.get("weight_version") is None else str(meta["weight_version"])
    add(sample.weight_version_spans, version, n - done)
    if version is not None:
        sample.weight_versions.append(version)


def version_spans(sample, held_version=None) -> list:
    """The spans over `sample`'s whole response: tokens no answer gave (held) first, as `held_version`."""
    spans: list = []
    answered = sample.weight_version_spans
    add(spans, held_version, len(sample.response_ids) - (answered[-1]["end"] if answered else 0))
    for s in answered:
        add(spans, s["version"], s["end"] - s["start"])
    return spans


class Versions:
    """Weight versions in update order: integers compare as such, others in the order first seen."""

    def __init__(self):
        self.order: dict = {}
        self.current: Optional[str] = None

    def rank(self, version) -> float:
        if version is None:
            return -math.inf   # unknown: the oldest
        try:
            return float(int(version))
        except ValueError:
            return float(self.order.setdefault(version, len(self.order)))

    def see(self, version) -> None:
        if version is not None and (self.current is None or self.rank(version) > self.rank(self.current)):
            self.current = str(version)

    def lag(self, spans_of_group: list) -> float:
        """How many versions the group's oldest token is behind the current one."""
        oldest = min((self.rank(s["version"]) for spans in spans_of_group for s in spans), default=math.inf)
        return 0.0 if self.current is None or oldest == math.inf else self.rank(self.current) - oldest


class StaleGate:
    """A sink in front of `sink` (`run`'s stream, `serve`'s feed) that enforces `rollout.max_weight_version_lag`
    as slime's fully-async function does: a finished group whose oldest token is more than `lag` versions behind
    the current one (the newest any token or `current()` names) is not delivered; `regenerate` starts it again
    from its prompt under the same id (through the manager's `refill`), `drop` forgets it. Both are counted
    (`stale`, and `stale_tokens` thrown away)."""

    def __init__(self, sink, lag: Optional[int], policy: str = "regenerate", current=lambda: None):
        self.sink, self.lag, self.policy, self.current = sink, lag, policy, current
        self.versions = Versions()
        self.redo: list = []
        self.stale = {"regenerate": 0, "drop": 0}
        self.stale_tokens = 0

    async def put(self, group) -> bool:
        spans = [version_spans(s) for s in group.samples]
        for version in [x["version"] for sp in spans for x in sp] + [self.current()]:
            self.versions.see(version)
        if self.lag is None or self.versions.lag(spans) <= self.lag:
            return await self.sink.put(group)
        self.stale[self.policy] += 1
        self.stale_tokens += sum(len(s.response_ids) for s in group.samples)
        if self.policy == "regenerate":
            self.redo.append(Group.fresh(group.group_id, group.prompt_ids, len(group.samples)))
        return False

    def refill(self) -> list:
        out, self.redo = self.redo, []
        return out

    def line(self) -> str:
        return f"{self.stale['regenerate']} regenerated, {self.stale['drop']} dropped ({self.stale_tokens} tokens)"
