"""Engine state, one owner: which engines are admitted, what each is, its load in flight, and the events.

The pool (`dispatch.Dispatcher`) writes it: `admit` when a source hands it an engine, `remove` when the
engine is lost, `close` / `reopen` when no engine will come back / engines are back; it books each
attempt on an entry (`outstanding`, `served`, `inflight`). Everyone else reads it: placement learns of
ranks come and gone, the health monitor of engines to watch (both through `listen`), the sources which
engines are admitted (`slots`), the manager whether the pool is closed. An engine not in `slots` is not
admitted (starting, dead, restarting or given up: its source knows which and logs it).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from rollout.errors import DispatcherClosed

Listener = Callable[["EngineEntry"], None]


class EngineEntry:
    """One admitted engine: what readiness and /server_info said of it, and its load in flight."""

    def __init__(self, engine, capacity: int, dp_ranks: int = 1, version: Optional[str] = None,
                 compact: bool = False, replicas: bool = False):
        self.engine, self.capacity = engine, capacity
        self.dp_ranks = max(1, int(dp_ranks or 1))    # DP ranks (placement pins ranks when > 1)
        self.replicas = replicas and self.dp_ranks > 1  # they are plain --dp-size replicas: each probed alone
        self.version = version                        # weight version the engine reported last
        self.compact = compact                        # ask for compact routed experts (engine advertises them)
        self.outstanding = self.served = 0            # attempts in flight, answered
        self.suspect_until = 0.0                      # after a connection error or a malformed answer: avoid a moment
        self.inflight: dict[str, asyncio.Task] = {}   # rid -> the task awaiting that attempt
        self.lost: set = set()                        # rids cancelled by remove()

    @property
    def name(self) -> str:
        return self.engine.name

    def suspect(self, now: float) -> bool:
        return self.suspect_until > now

    def release(self, served: bool = True) -> None:
        """An attempt booked by `EngineTable.take` ended (`served`: it got an answer)."""
        self.outstanding -= 1
        self.served += int(served)


class EngineTable:
    def __init__(self):
        self.slots: dict[str, EngineEntry] = {}       # admitted engines by name
        self.routed_formats: dict[str, str] = {}      # engine -> "routed experts: compact" or ": int32 (why)"
        self.closed_reason: Optional[str] = None      # set: no engine will come back
        self._admitted: list[Listener] = []
        self._removed: list[Listener] = []

    def listen(self, admitted: Optional[Listener] = None, removed: Optional[Listener] = None) -> None:
        """Call `admitted(entry)` after an engine is admitted, `removed(entry)` after one is removed."""
        if admitted:
            self._admitted.append(admitted)
        if removed:
            self._removed.append(removed)

    def admit(self, engine, capacity: int, dp_ranks: Optional[int] = None, version: Optional[str] = None,
              compact: bool = False, replicas: bool = False) -> EngineEntry:
        entry = self.slots[engine.name] = EngineEntry(engine, capacity, dp_ranks, version, compact, replicas)
        for fn in self._admitted:
            fn(entry)
        return entry

    def replicas(self, engine) -> int:
        """How many plain DP replicas the admitted `engine` (that very object) has; 1 when its ranks are not
        replicas (one rank, or DP attention: they step together) or it is not admitted."""
        entry = self.slots.get(engine.name)
        return entry.dp_ranks if entry is not None and entry.engine is engine and entry.replicas else 1

    def remove(self, engine) -> Optional[EngineEntry]:
        """Take `engine` (that very object, not a restarted one of the same name) out; its entry, or None."""
        entry = self.slots.get(engine.name)
        if entry is None or entry.engine is not engine:
            return None
        del self.slots[engine.name]
        for fn in self._removed:
            fn(entry)
        return entry

    def take(self, name: Optional[str] = None) -> tuple:
        """(the least-outstanding free slot, then the least served, of engine `name` when given, booked (no
        await: atomic on the event loop), None) or, with none free, (None, when the first suspect slot's pause
        ends, or None). Raises DispatcherClosed once closed."""
        if self.closed_reason:
            raise DispatcherClosed(self.closed_reason)
        now = slot = paused = None   # one pass, no lists, the clock read only for a suspect: this runs per request
        for s in (self.slots.values() if name is None else [self.slots[name]] if name in self.slots else ()):
            if s.outstanding >= s.capacity:
                continue
            if s.suspect_until:
                now = now or time.monotonic()
                if s.suspect_until > now:
                    paused = s.suspect_until if paused is None else min(paused, s.suspect_until)
                    continue
            if slot is None or s.outstanding < slot.outstanding or \
                    (s.outstanding == slot.outstanding and s.served < slot.served):
                slot = s
        if slot is not None:
            slot.outstanding += 1
            return slot, None
        return None, paused

    def close(self, reason: str) -> None:
        self.closed_reason = reason

    def reopen(self) -> None:
        self.closed_reason = None

    def outstanding(self) -> dict:
        return {n: s.outstanding for n, s in self.slots.items()}

    def suspects(self) -> set:
        now = time.monotonic()
        return {n for n, s in self.slots.items() if s.suspect(now)}
