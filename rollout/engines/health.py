"""Health monitor for admitted engines.

Only engines handed to `watch()` are probed, and the manager calls `watch()` after readiness, so an
engine is never probed inside a start-up phase (slime's monitor probes during cold compile and
kills the engine on its first 503). An engine is declared dead after `failures` consecutive failed
probes, or at once when its process is gone (checked every 0.25 s).
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import aiohttp

from rollout.engines.readiness import auth_headers

Probe = Callable[[object], Awaitable[None]]
OnDead = Callable[[object, str], Awaitable[None]]


def http_probe(session: aiohttp.ClientSession, timeout_s: float) -> Probe:
    """GET /health_generate; any non-200 or error is a failed probe."""

    async def probe(engine) -> None:
        async with session.get(engine.url + "/health_generate", headers=auth_headers(engine.api_key),
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")

    return probe


class HealthMonitor:
    def __init__(self, probe: Probe, on_dead: OnDead, interval_s: float, failures: int,
                 alive_poll_s: float = 0.25):
        self.probe, self.on_dead = probe, on_dead
        self.interval_s, self.failures, self.alive_poll_s = interval_s, failures, alive_poll_s
        self.watched: dict[str, object] = {}
        self.fails: dict[str, int] = {}
        self.history: list[tuple[str, bool, str]] = []  # (engine, ok, detail), for tests and logs
        self._next_probe: dict[str, float] = {}
        self._busy: set[str] = set()
        self._task: asyncio.Task | None = None

    def watch(self, engine) -> None:
        self.watched[engine.name] = engine
        self.fails[engine.name] = 0
        self._next_probe[engine.name] = time.monotonic() + self.interval_s

    def unwatch(self, engine) -> None:
        self.watched.pop(engine.name, None)

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
        if self.watched.get(engine.name) is engine:
            self.unwatch(engine)
            await self.on_dead(engine, reason)

    async def _probe_one(self, engine) -> None:
        try:
            await self.probe(engine)
            ok, detail = True, "ok"
        except Exception as e:  # any failure counts; a probe never raises past here
            ok, detail = False, (str(e) or type(e).__name__)[:160]
        finally:
            self._busy.discard(engine.name)
        if self.watched.get(engine.name) is not engine:
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
                if now >= self._next_probe[name] and name not in self._busy:
                    self._busy.add(name)
                    self._next_probe[name] = now + self.interval_s
                    asyncio.create_task(self._probe_one(engine))
            await asyncio.sleep(self.alive_poll_s)
