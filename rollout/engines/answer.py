"""The one reader of a /generate answer: every field dispatch and placement use is checked here.

`parse(engine, body)` gives an `Answer` or raises `BadAnswer` (an `EngineError`, so the attempt is re-sent
elsewhere like a 5xx) with one line naming the engine and the field. Shapes are SGLang's (tests/facts/): an
object with `meta_info`; `finish_reason` an object whose `type` is stop, length or abort; each
`output_token_logprobs` entry `[logprob, token_id, ...]`; token counts integers (absent, as in a queued abort,
reads 0). `meta_info["routed_experts"]` is left to `routed_experts.sample_routed_experts`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rollout.errors import EngineError

FINISH_TYPES = ("stop", "length", "abort")
_INT, _FLOAT, _NUMBER, _PAIR = {int}, {float}, {int, float}, {list, tuple}


class BadAnswer(EngineError):
    """A 200 answer of the wrong shape: this attempt failed; re-sent elsewhere."""
    transient = True

    def __init__(self, engine: str, field: str, why: str):
        self.engine, self.field = engine, field
        super().__init__(f"malformed answer from {engine}: {field} {why}")


@dataclass(slots=True)
class Answer:
    meta: dict
    text: str
    finish: Optional[str]          # stop, length, abort; None when SGLang gave no finish_reason
    token_ids: list
    logprobs: list
    weight_version: Optional[str]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def kept(self) -> dict:
        """meta_info without routed experts (what a caller keeping answers stores)."""
        return {k: v for k, v in self.meta.items() if k != "routed_experts"}


def _count(engine: str, meta: dict, key: str) -> int:
    v = meta.get(key, 0)
    if type(v) is not int or v < 0:
        raise BadAnswer(engine, f"meta_info.{key}", f"is {v!r}, not a count")
    return v


def _pairs(engine: str, meta: dict) -> tuple:
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        return [], []
    if not isinstance(pairs, list):
        raise BadAnswer(engine, "meta_info.output_token_logprobs", f"is a {type(pairs).__name__}, not a list")
    try:   # the whole answer at once (the hot path); any doubt: item by item, to name the bad one
        ids, lps = [p[1] for p in pairs], [p[0] for p in pairs]
        kinds = set(map(type, lps))
        if kinds <= _NUMBER and set(map(type, ids)) <= _INT and set(map(type, pairs)) <= _PAIR \
                and (not ids or min(ids) >= 0):
            return ids, lps if kinds <= _FLOAT else [float(x) for x in lps]
    except (TypeError, IndexError, KeyError):
        pass
    for i, p in enumerate(pairs):
        ok = isinstance(p, (list, tuple)) and len(p) >= 2 and type(p[1]) is int and p[1] >= 0 \
            and isinstance(p[0], (int, float)) and not isinstance(p[0], bool)
        if not ok:
            raise BadAnswer(engine, f"meta_info.output_token_logprobs[{i}]", f"is {p!r}, not [logprob, token_id]")
    return [p[1] for p in pairs], [float(p[0]) for p in pairs]


def parse(engine: str, body) -> Answer:
    if not isinstance(body, dict):
        raise BadAnswer(engine, "body", f"is a {type(body).__name__}, not an object")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise BadAnswer(engine, "meta_info", "is missing" if meta is None else f"is a {type(meta).__name__}")
    fr = meta.get("finish_reason")
    finish = fr.get("type") if isinstance(fr, dict) else None
    if fr is not None and finish not in FINISH_TYPES:
        raise BadAnswer(engine, "meta_info.finish_reason", f"is {fr!r}, not an object of type {'/'.join(FINISH_TYPES)}")
    text = body.get("text", "")
    if not isinstance(text, str):
        raise BadAnswer(engine, "text", f"is a {type(text).__name__}, not a string")
    version = meta.get("weight_version")
    if version is not None and not isinstance(version, (str, int)):
        raise BadAnswer(engine, "meta_info.weight_version", f"is {version!r}")
    ids, lps = _pairs(engine, meta)
    return Answer(meta, text, finish, ids, lps, None if version is None else str(version),
                  _count(engine, meta, "prompt_tokens"), _count(engine, meta, "completion_tokens"),
                  _count(engine, meta, "cached_tokens"))
