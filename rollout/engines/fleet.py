"""A managed fleet: the engines this process launches, admits, watches and restarts.

`open(pool)` starts every spec with the backend and admits each engine only after every readiness
phase. The health monitor (or a dead process) removes an engine (one of plain DP replicas also when one
replica is wedged: each is probed alone); its in-flight samples are re-sent to the others by the pool;
the engine is restarted and re-admitted only after every readiness phase and, once weights were updated
(`weight_version` set), after the weight-version check hook. Every restart failure (whatever its
exception) is logged and counted, restarts back off, and when every engine is given up the pool is
closed with one line naming engines and causes.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from rollout.engines.health import (HEALTH_WINDOW_ENV, SGLANG_HEALTH_WINDOW_S, HealthMonitor, http_probe, per_replica,
                                   replica_probe)
from rollout.engines.readiness import NullView, wait_ready
from rollout.engines.source import EngineSource
from rollout.errors import WeightVersionError, one_line
from rollout.types import EngineEvent

WeightHook = Callable[[object, str], Awaitable[None]]   # (restarted engine, expected version)


@dataclass(frozen=True)
class Restarts:
    max_restarts: int = 3
    backoff_s: float = 1.0        # doubled per failed attempt ...
    backoff_max_s: float = 30.0   # ... up to this


class ManagedFleet(EngineSource):
    def __init__(self, specs, backend, budgets, health, *, view=None, restart_view=None,
                 weight_sync_hook: Optional[WeightHook] = None, restarts: Restarts = Restarts(), probe=None,
                 max_events: int = 10000, allow_unfixed: bool = False):
        """`view`: start-up progress (`restart_view`, default the same: restarted engines); `probe`: the
        health probe (default `http_probe` over the pool's client)."""
        super().__init__(max_events)
        self.specs = {s.name: s for s in specs}
        self.backend, self.budgets, self.health_cfg = backend, budgets, health
        self.allow_unfixed = allow_unfixed   # rollout.allow_unfixed: admit engines without their needed fixes
        self.view = view or NullView()
        self.restart_view = restart_view or self.view
        self.weight_sync_hook, self.restarts, self._probe = weight_sync_hook, restarts, probe
        self.engines: dict[str, object] = {}
        self.restart_failures: collections.Counter = collections.Counter()   # engine -> failed restarts
        self.given_up: dict[str, str] = {}                                   # engine -> last cause
        self._recoveries: dict[str, asyncio.Task] = {}
        self.pool = None
        self.monitor: Optional[HealthMonitor] = None

    @property
    def planned(self) -> int:
        return len(self.specs)

    async def open(self, pool) -> None:
        self.pool = pool
        client, timeout_s = pool.client, self.health_cfg.timeout_s
        probe = self._probe or per_replica(http_probe(client, timeout_s), replica_probe(client, timeout_s),
                                           pool.engines.replicas)
        self.monitor = HealthMonitor(probe, self._on_dead, self.health_cfg.interval_s, self.health_cfg.failures,
                                     server_window_s=self._server_health_window())
        pool.engines.listen(admitted=lambda e: self.monitor.watch(e.engine),   # what is admitted is watched
                            removed=lambda e: self.monitor.unwatch(e.engine))
        results = await asyncio.gather(*(self._bring_up(spec) for spec in self.specs.values()),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self.monitor.start()

    def _server_health_window(self) -> float:
        """SGLang's /health_generate window: the longest SGLANG_HEALTH_CHECK_TIMEOUT an engine group sets."""
        windows = [float(s.group.env[HEALTH_WINDOW_ENV]) for s in self.specs.values()
                   if HEALTH_WINDOW_ENV in getattr(s.group, "env", {})]
        return max(windows, default=SGLANG_HEALTH_WINDOW_S)

    async def _bring_up(self, spec, restart: bool = False):
        """Start one engine and admit it after every readiness phase (and the weight check)."""
        engine = await asyncio.to_thread(self.backend.start, spec)
        self.engines[spec.name] = engine
        self.events.log(spec.name, EngineEvent.STARTED, f"pid {engine.pid}")
        try:
            info = await wait_ready(engine, self.budgets, self.pool.client, self.restart_view if restart else self.view,
                                    allow_unfixed=self.allow_unfixed)
            if restart and self.weight_version is not None:
                await self._check_weights(engine, info.weight_version)
        except BaseException:
            await asyncio.to_thread(engine.stop)
            raise
        await self.pool.enlist(engine, info.weight_version, ask_version=False, dp_ranks=info.dp_size,
                               replicas=info.replicas)
        self.events.log(spec.name, EngineEvent.ADMITTED, self.pool.routed_formats.get(spec.name, ""))
        return engine

    async def close(self) -> None:
        if self.monitor:
            await self.monitor.stop()
        for t in self._recoveries.values():
            t.cancel()
        for t in list(self._recoveries.values()):
            try:
                await t
            except BaseException:
                pass
        await asyncio.gather(*(asyncio.to_thread(e.stop) for e in self.engines.values()),
                             return_exceptions=True)
        await asyncio.to_thread(self.backend.shutdown)

    async def _check_weights(self, engine, reported: Optional[str]) -> None:
        if reported != self.weight_version and self.weight_sync_hook is not None:
            await self.weight_sync_hook(engine, self.weight_version)
            reported = await self.pool.client.weight_version(engine)
        if reported != self.weight_version:
            raise WeightVersionError(f"engine {engine.name}: weight version {reported!r} != expected "
                                     f"{self.weight_version!r}; not admitted")

    # ------------------------------------------------------------------ recovery
    async def on_error(self, engine) -> None:
        """A request to `engine` failed at the connection level: if its process is gone, act now."""
        if not engine.alive() and self.monitor.watches(engine):
            self.monitor.unwatch(engine)
            await self._on_dead(engine, engine.exit_reason())

    async def _on_dead(self, engine, reason: str) -> None:
        n = await self.pool.remove(engine)
        self.events.log(engine.name, EngineEvent.DEAD, f"{reason}; {n} in-flight request(s) re-sent")
        if engine.name not in self._recoveries or self._recoveries[engine.name].done():
            task = asyncio.create_task(self._recover(engine, reason))
            task.add_done_callback(lambda t, name=engine.name: self._recovery_done(name, t))
            self._recoveries[engine.name] = task

    async def _recover(self, engine, cause: str) -> None:
        """Restart with backoff; any exception of an attempt is logged, counted and retried."""
        spec, r = self.specs[engine.name], self.restarts
        try:
            await asyncio.to_thread(engine.stop)
        except Exception as e:  # a dead engine that cannot be stopped cleanly is still restarted
            self.events.log(spec.name, EngineEvent.RESTART_FAILED, f"stopping the dead process: {one_line(e, 300)}")
        for attempt in range(1, r.max_restarts + 1):
            if attempt > 1:
                await asyncio.sleep(min(r.backoff_max_s, r.backoff_s * 2 ** (attempt - 2)))
            try:
                await self._wait_port(spec)
                await self._bring_up(spec, restart=True)
            except Exception as e:
                cause = one_line(e, 300)
                self.restart_failures[spec.name] += 1
                self.events.log(spec.name, EngineEvent.RESTART_FAILED, f"restart {attempt}: {cause}")
                continue
            self.events.log(spec.name, EngineEvent.READMITTED, f"restart {attempt} passed every readiness phase")
            return
        await self._give_up(spec.name, cause)

    def _recovery_done(self, name: str, task: asyncio.Task) -> None:
        """Belt and braces: a recovery task that died of an unexpected error still gives the engine up."""
        if task.cancelled() or task.exception() is None or name in self.given_up:
            return
        cause = f"recovery crashed: {one_line(task.exception())}"
        self.events.log(name, EngineEvent.RESTART_FAILED, cause)
        asyncio.get_running_loop().create_task(self._give_up(name, cause))

    async def _give_up(self, name: str, cause: str) -> None:
        self.given_up[name] = cause
        self.events.log(name, EngineEvent.GIVEN_UP, f"{self.restarts.max_restarts} restart(s) failed (last: {cause})")
        others = [t for n, t in self._recoveries.items() if n != name and not t.done()]
        if not self.pool.engines.slots and not others:
            reason = "every engine is lost: " + "; ".join(f"{n}: {c}" for n, c in sorted(self.given_up.items()))
            self.events.log(name, EngineEvent.ALL_LOST, reason)
            await self.pool.close(reason)

    async def _wait_port(self, spec, budget_s: float = 15.0) -> None:
        from rollout.engines.process import port_in_use
        end = time.monotonic() + budget_s
        while port_in_use(spec.host, spec.port) and time.monotonic() < end:
            await asyncio.sleep(0.2)
