"""States the rollout manager reports, as enums (callers compare values, never parse message text).

Both enums mix in `str`, so a value compares equal to its text and lands in JSON as that text.
"""
from __future__ import annotations

from enum import Enum


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


FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
