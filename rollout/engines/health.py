"""Health monitor for admitted engines.

Only engines handed to `watch()` are probed, and the manager calls `watch()` after readiness, so an
engine is never probed inside a start-up phase (slime's monitor probes during cold compile and
kills the engine on its first 503). An engine is declared dead after `failures` consecutive failed
probes, or at once when its process is gone (checked every 0.25 s).

Busy is not dead (sglang#22511): SGLang's `/health_generate` answers 503 when no scheduler output
reached the HTTP server within its window (`SGLANG_HEALTH_CHECK_TIMEOUT`, 20 s). 0.5.23 answers a
probe after each forward while busy, so one forward longer than the window (a long unchunked or
large-chunk prefill, a large batch) fails it. `http_probe` then looks for progress during the probe:
the scheduler's `/v1/loads` snapshot changed (published after every prefill batch), or, for a local
engine, its scheduler processes used CPU and none is stopped. Progress makes the probe pass as
"busy"; CPU alone counts for at most `busy_budget_s` since the last snapshot change, so a scheduler
spinning in a hang is still declared dead. A stopped (SIGSTOP) or hung scheduler shows neither.
Remote engines have only the snapshot: keep `failures x interval_s` above the longest forward.

Plain `--dp-size` replicas do not step together, and `/health_generate` passes when any replica answers
(SGLang round-robins the probe over the replicas and takes any scheduler output as its answer), so a
wedged replica never fails it on a busy engine. `per_replica` adds, each round, a one-token /generate
pinned to each replica (`replica_probe`), judged like `http_probe` on that replica's own `/v1/loads`
entry and scheduler process; a round in which a replica fails is a failed probe of the engine, which
is then declared dead as a whole (a replica cannot be restarted alone: docs/manager.md).

One probe per engine, counted as SGLang counts it (sglang#35884): `/health_generate` sends a real
one-token request and waits its window; a client that gives up first leaves that handler (and its
request) running, and the next probe adds another. A probe that got no HTTP answer (`NO_ANSWER` in its
detail, failed or busy) keeps the engine's slot until SGLang's window (`server_window_s`) has passed
since it began: SGLang ends it (503, state popped; a busy scheduler drops its request) first.
"""
from __future__ import annotations

import asyncio
import collections
import re
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from rollout.engines.answer import BadAnswer
from rollout.engines.client import EngineClient
from rollout.engines.readiness import NoToken, WrongRank, probe_dp_rank
from rollout.errors import EngineError, EngineRejected, EngineUnreachable, one_line, short_error

Probe = Callable[[object], Awaitable[Optional[str]]]  # raises = failed; returns a detail or None = ok
RankProbe = Callable[[object, int], Awaitable[Optional[str]]]  # (engine, DP rank): the same, for one replica
OnDead = Callable[[object, str], Awaitable[None]]
HEALTH_WINDOW_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"  # an engine's /health_generate window (s)
SGLANG_HEALTH_WINDOW_S = 20.0  # its default
NO_ANSWER = "no answer"  # a probe's detail: client timeout or connection error, SGLang may still hold it


class ProbeFailed(Exception):
    """One health probe failed: the engine neither answered 200 nor showed progress."""


def http_probe(client: EngineClient, timeout_s: float, busy_budget_s: float = 300.0) -> Probe:
    """GET /health_generate. 200: healthy. Otherwise the probe passes as "busy ..." when the engine
    made progress meanwhile (see module doc), and fails (raises) when it did not."""
    seen: dict = {}   # engine -> (snapshot, monotonic time it last changed)

    async def probe(engine) -> str | None:
        before = await progress_mark(client, engine, timeout_s)
        try:
            await client.health_generate(engine, timeout_s)
            return None
        except EngineRejected as e:
            failure = f"HTTP {e.status}"
        except EngineUnreachable as e:
            failure = f"{NO_ANSWER}: {str(e.cause) or type(e.cause).__name__}"
        return judge(seen, engine.name, failure, before, await progress_mark(client, engine, timeout_s), busy_budget_s)

    return probe


def replica_probe(client: EngineClient, timeout_s: float, busy_budget_s: float = 300.0) -> RankProbe:
    """A one-token /generate pinned to one plain-DP replica (`readiness.probe_dp_rank`). A token from that
    replica: healthy. Otherwise it passes as "busy ..." when that replica made progress meanwhile (its
    own `/v1/loads` entry, its own scheduler's CPU), and fails when it did not (see module doc)."""
    seen: dict = {}   # (engine, rank) -> (snapshot, monotonic time it last changed)

    async def probe(engine, rank: int) -> str | None:
        before = await progress_mark(client, engine, timeout_s, rank)
        try:
            await probe_dp_rank(client, engine, rank, timeout_s)
            return None
        except EngineRejected as e:
            failure = f"HTTP {e.status}"
        except EngineUnreachable as e:   # not NO_ANSWER: a /generate is not held for a window (sglang#35884)
            failure = f"no token within {timeout_s:g} s ({short_error(e.cause)})"
        except (NoToken, WrongRank, BadAnswer) as e:
            failure = one_line(e)
        after = await progress_mark(client, engine, timeout_s, rank)
        return judge(seen, (engine.name, rank), failure, before, after, busy_budget_s)

    return probe


def per_replica(probe: Probe, rank_probe: RankProbe, replicas: Callable[[object], int]) -> Probe:
    """`probe`, and beside it one `rank_probe` per replica of an engine of plain DP replicas (`replicas(engine)`
    > 1): the round fails when either fails, naming the replica."""
    async def both(engine) -> str | None:
        n = replicas(engine)
        if n < 2:
            return await probe(engine)
        results = await asyncio.gather(probe(engine), *(rank_probe(engine, r) for r in range(n)),
                                       return_exceptions=True)
        names = ["engine"] + [f"DP replica {r}" for r in range(n)]
        failed = [f"{who}: {one_line(r)}" for who, r in zip(names, results) if isinstance(r, BaseException)]
        if failed:
            raise ProbeFailed("; ".join(failed))
        return "; ".join(f"{who}: {r}" for who, r in zip(names, results) if r) or None

    return both


def judge(seen: dict, key, failure: str, before: "Progress", after: "Progress", busy_budget_s: float) -> str:
    """A failed probe's verdict: "busy ..." when the scheduler made progress during it (its snapshot moved,
    or its CPU within `busy_budget_s` of the snapshot's last change, none stopped); else raises ProbeFailed.
    `seen[key]`: (last snapshot, when it last changed), kept across probes."""
    now = time.monotonic()
    last, changed_at = seen.get(key, (before.snapshot, now))
    if after.snapshot is not None and after.snapshot != last:
        changed_at = now
    seen[key] = (after.snapshot, changed_at)
    if after.snapshot is not None and after.snapshot != before.snapshot:
        return f"busy ({failure}; scheduler iterated during the probe)"
    if after.cpu_s is not None and before.cpu_s is not None and after.cpu_s > before.cpu_s \
            and not after.stopped and now - changed_at < busy_budget_s:
        return (f"busy ({failure}; scheduler used {after.cpu_s - before.cpu_s:.1f} s CPU, "
                f"no scheduler iteration for {now - changed_at:.0f} s)")
    why = "scheduler stopped" if after.stopped else "no progress during the probe"
    raise ProbeFailed(f"{failure}; {why}")


@dataclass(frozen=True)
class Progress:
    snapshot: tuple | None  # /v1/loads per DP rank: (timestamp, counters); None when unreadable
    cpu_s: float | None  # CPU seconds of the local scheduler processes; None for remote engines
    stopped: bool = False  # a local scheduler process is stopped (SIGSTOP) or a zombie


async def progress_mark(client: EngineClient, engine, timeout_s: float, rank: Optional[int] = None) -> Progress:
    """The engine's progress now; of its DP rank `rank` only when given."""
    snapshot = None
    try:
        loads = await client.loads(engine, timeout_s)
        snapshot = tuple(tuple(ld.get(k) for k in LOAD_KEYS) for ld in loads
                         if rank is None or ld.get("dp_rank") == rank) or None
    except (EngineError, AttributeError):
        pass
    cpu_s, stopped = scheduler_cpu(engine, rank)
    return Progress(snapshot, cpu_s, stopped)


LOAD_KEYS = ("dp_rank", "timestamp", "total_prefill_busy_us", "total_prefill_uncached_tokens", "num_used_tokens",
             "num_running_reqs", "num_waiting_reqs")


def scheduler_cpu(engine, rank: Optional[int] = None) -> tuple:
    """(CPU seconds of the engine's scheduler processes, any of them stopped); (None, False) when the
    engine is not a local process tree. `rank`: only DP rank `rank`'s (SGLang names them
    `sglang::scheduler_DP<rank>`, then `_TP<t>` ... when tp > 1)."""
    import psutil

    if getattr(engine, "backend", "local") != "local" or getattr(engine, "pid", None) is None:
        return None, False
    try:
        procs = psutil.Process(engine.pid).children(recursive=True)
    except psutil.Error:
        return None, False
    total, stopped, found = 0.0, False, False
    for p in procs:
        try:
            name = p.name()
            if "scheduler" not in name or (rank is not None and not re.search(rf"scheduler_DP{rank}(_|$)", name)):
                continue
            found = True
            stopped |= p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE)
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return (total if found else None), stopped


class HealthMonitor:
    def __init__(self, probe: Probe, on_dead: OnDead, interval_s: float, failures: int,
                 alive_poll_s: float = 0.25, history: int = 1000, server_window_s: float = SGLANG_HEALTH_WINDOW_S):
        self.probe, self.on_dead = probe, on_dead
        self.interval_s, self.failures, self.alive_poll_s = interval_s, failures, alive_poll_s
        self.watched: dict[str, object] = {}
        self.fails: dict[str, int] = {}
        # (engine, ok, detail), for tests and logs; bounded: a long `serve` probes forever
        self.history: collections.deque = collections.deque(maxlen=history)
        self._next_probe: dict[str, float] = {}
        self._busy: set[str] = set()
        self.server_window_s = server_window_s
        self._held_until: dict[str, float] = {}  # engine -> when SGLang has ended an abandoned probe
        self._task: asyncio.Task | None = None

    def watch(self, engine) -> None:
        self.watched[engine.name] = engine
        self.fails[engine.name] = 0
        self._next_probe[engine.name] = time.monotonic() + self.interval_s

    def unwatch(self, engine) -> None:
        self.watched.pop(engine.name, None)

    def watches(self, engine) -> bool:
        return self.watched.get(engine.name) is engine

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _declare(self, engine, reason: str) -> None:
        if self.watches(engine):
            self.unwatch(engine)
            await self.on_dead(engine, reason)

    async def _probe_one(self, engine) -> None:
        started = time.monotonic()
        try:
            ok, detail = True, (await self.probe(engine)) or "ok"
        except Exception as e:  # any failure counts; a probe never raises past here
            ok, detail = False, (str(e) or type(e).__name__)[:160]
        finally:
            self._busy.discard(engine.name)
        if NO_ANSWER in detail:  # sglang#35884: SGLang's handler may still run; no second probe beside it
            self._held_until[engine.name] = started + self.server_window_s
        if not self.watches(engine):
            return
        self.history.append((engine.name, ok, detail))
        if ok:
            self.fails[engine.name] = 0
            return
        self.fails[engine.name] += 1
        if self.fails[engine.name] >= self.failures:
            await self._declare(engine, f"{self.failures} consecutive health probes failed (last: {detail})")

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            for name, engine in list(self.watched.items()):
                if not engine.alive():
                    await self._declare(engine, engine.exit_reason())
                    continue
                if now >= self._next_probe[name] and name not in self._busy \
                        and now >= self._held_until.get(name, 0.0):
                    self._busy.add(name)
                    self._next_probe[name] = now + self.interval_s
                    asyncio.create_task(self._probe_one(engine))
            await asyncio.sleep(self.alive_poll_s)
