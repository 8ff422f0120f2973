"""Engines started by someone else: fixed endpoints, or those a `discover` call lists now (slime's router).

Nothing is launched and no health monitor runs. `discover` is async (client) -> (endpoints to send to,
endpoints to abort on), its `str` names it in errors; it is read at `open()`, at every `relist()` and
after a connection error. An empty list is re-read for up to `empty_wait_s` before samples fail.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from rollout.engines.source import EngineSource
from rollout.errors import EngineError

Discover = Callable[[object], Awaitable[tuple]]   # (client) -> (send to, abort on) lists of Endpoint


class AttachedWorkers(EngineSource):
    def __init__(self, endpoints=(), discover: Optional[Discover] = None, empty_wait_s: float = 60.0):
        super().__init__()
        self.endpoints, self.discover, self.empty_wait_s = list(endpoints), discover, empty_wait_s
        self.pool = None
        self._listing: Optional[asyncio.Future] = None
        self._listed_at = 0.0

    async def open(self, pool) -> None:
        self.pool = pool
        for endpoint in self.endpoints:
            await pool.enlist(endpoint)
        await self.relist()

    async def relist(self, max_age_s: float = 0.0, wait_s: Optional[float] = None) -> None:
        """Follow what `discover` lists now (no-op without it, or when it was read under `max_age_s` ago):
        admit new engines, remove gone ones (their requests are re-sent). Concurrent calls share one read."""
        if self.discover is None or time.monotonic() - self._listed_at < max_age_s:
            return
        if self._listing is None or self._listing.done():
            wait = self.empty_wait_s if wait_s is None else wait_s
            self._listing = asyncio.ensure_future(self._relist(time.monotonic() + wait))
        await asyncio.shield(self._listing)

    async def _relist(self, until: float) -> None:
        pool = self.pool
        while True:
            send, abort = await self.discover(pool.client)
            if send or time.monotonic() >= until:
                break
            await asyncio.sleep(0.5)
        self.abort_to = list(abort) or None
        names = {e.name for e in send}
        for slot in list(pool.engines.slots.values()):
            if slot.engine.name not in names:
                await pool.remove(slot.engine)
        for e in send:
            if e.name not in pool.engines.slots:
                await pool.enlist(e)
        self._listed_at = time.monotonic()
        if send:
            await pool.reopen()
        else:
            await pool.close(f"{self.discover} lists no workers")

    async def on_error(self, engine) -> None:
        """Whoever started the engines may have removed or replaced that one: list them again now."""
        if self.discover is None:
            return
        try:
            await self.relist(max_age_s=1.0, wait_s=0.0)
        except EngineError:
            pass   # the lister is unreachable too: the next relist() tries again
