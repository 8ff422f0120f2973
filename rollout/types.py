"""The rollout's data types and every status it reports, in one place.

`Sample` and `Group` are what the dispatcher fills and the stream delivers; `Endpoint` is an engine
started by someone else; `Event` is what happened to an engine, kept in an `EventLog`; `SampleStatus`
and `EngineEvent` are enums (callers compare members, never message text). Both enums mix in `str`, so
a value lands in JSON as its text.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class SampleStatus(str, Enum):
    """Where one sample stands."""

    PENDING = "pending"  # not generated yet (or re-sent from scratch after its engine was lost)
    COMPLETED = "completed"  # finished with a stop token/string
    TRUNCATED = "truncated"  # finished at max_new_tokens
    ABORTED = "aborted"  # stopped by an abort (batch full); resumed at the next rollout() call
    FAILED = "failed"  # given up; `error` says why (one line)

    @property
    def runnable(self) -> bool:
        """The dispatcher still owes this sample a generation."""
        return self in (SampleStatus.PENDING, SampleStatus.ABORTED)

    @property
    def finished(self) -> bool:
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


class EngineEvent(str, Enum):
    """What happened to an engine (`RolloutManager.events`)."""

    STARTED = "started"  # process launched; readiness phases follow
    ADMITTED = "admitted"  # every readiness phase passed: receives requests
    DEAD = "dead"  # removed (process gone or N failed health probes); in-flight requests re-sent
    RESTART_FAILED = "restart failed"  # one restart attempt failed (start, readiness, weight check or other)
    READMITTED = "re-admitted"  # restarted and admitted again
    GIVEN_UP = "given up"  # no more restarts: the engine stays out
    ALL_LOST = "all engines lost"  # every engine given up: rollout() fails at once


# SGLang's meta_info.finish_reason.type -> the sample's status
FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass
class Sample:
    sample_id: str                 # "<group_id>/<index>": the dedupe key
    group_id: str
    index: int
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    routed_experts: Any = None     # compact numpy array [len(tokens)-1, moe_layers, topk], or None
    status: SampleStatus = SampleStatus.PENDING
    error: Optional[str] = None
    reward: Optional[float] = None
    engines: list = field(default_factory=list)   # engine of every attempt, in order
    dp_rank: Optional[int] = None  # DP rank of the last placed attempt (group placement)
    attempts: int = 0
    failures: int = 0              # failed attempts in a row (reset by any answer)
    resumes: int = 0               # partial-rollout continuations
    max_new_tokens: Optional[int] = None   # per-sample override of sampling.max_new_tokens
    weight_versions: list = field(default_factory=list)
    weight_version_spans: list = field(default_factory=list)   # rollout.versions: the version of each token
    sent_version: Optional[str] = None   # the engine's weight version last reported when the attempt was sent
    outputs: list = field(default_factory=list)   # (tokens, text, meta_info) of every answer, when kept
    t_submit: float = 0.0
    t_done: float = 0.0

    @property
    def tokens(self) -> list:
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def num_tokens(self) -> int:
        """len(tokens), without building them."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def engine(self) -> Optional[str]:
        return self.engines[-1] if self.engines else None


def group_id(run_id: str, n: int) -> str:
    """The id of group `n` of a run: `<run_id>-g<n>` (unique across runs; `run --resume` re-creates it)."""
    return f"{run_id}-g{n}"


@dataclass
class Group:
    group_id: str
    prompt_ids: list
    samples: list

    @classmethod
    def fresh(cls, group_id: str, prompt_ids, n: int) -> "Group":
        """`n` samples of one prompt, none generated; sample ids are `<group_id>/<i>`."""
        return cls(group_id, list(prompt_ids), [Sample(f"{group_id}/{i}", group_id, i, list(prompt_ids))
                                                for i in range(n)])

    @property
    def failed(self) -> bool:
        return any(s.status is SampleStatus.FAILED for s in self.samples)


@dataclass
class Endpoint:
    """An engine started by someone else (e.g. a worker behind slime's router)."""
    name: str
    url: str
    api_key: Optional[str] = None


@dataclass(frozen=True)
class Event:
    seq: int                 # 0, 1, ... per log: `since(seq)` reads only what is new
    t: float                 # time.monotonic()
    engine: str
    kind: EngineEvent
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value


class EventLog:
    """The engine events of one engine source, bounded (the oldest drop off after `max_events`: long serves)."""

    def __init__(self, max_events: int = 10000):
        self.events: collections.deque[Event] = collections.deque(maxlen=max_events)
        self._seq = itertools.count()

    def log(self, engine: str, kind: EngineEvent, detail: str = "") -> Event:
        ev = Event(next(self._seq), time.monotonic(), engine, EngineEvent(kind), detail)
        self.events.append(ev)
        return ev

    def since(self, seq: int) -> list:
        """Events with seq >= `seq` still held."""
        return [e for e in self.events if e.seq >= seq]

    def count(self, kind: EngineEvent) -> int:
        return sum(e.kind == kind for e in self.events)
