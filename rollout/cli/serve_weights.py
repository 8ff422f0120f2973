"""Managed mode: a restarted engine must not serve slime off-policy.

A restarted engine has the base checkpoint's weights and is outside slime's weight-update group; slime's
external mode does not resync it, and `serve` does not know slime's router (which still routes to the
engine's address). So `serve`:
- tracks the weight version its live engines report (`/model_info`) as the manager's expected version;
- before re-admitting a restarted engine whose version differs: loads `rollout.restart_checkpoint` if set
  (`/update_weights_from_disk` with the expected version); if the version still differs, pauses the
  engine (`/pause_generation`), says so on stderr, and resumes it (`/continue_generation`) only once its
  version equals its peers'.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from rollout.net import auth_headers


class WeightGuard:
    def __init__(self, checkpoint, say, poll_s: float = 2.0):
        self.checkpoint, self.say, self.poll_s = checkpoint, say, poll_s
        self.mgr = None

    async def _post(self, engine, path: str, body: dict, timeout_s: float = 600.0) -> None:
        async with self.mgr.session.post(engine.url + path, json=body, headers=auth_headers(engine.api_key),
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise RuntimeError(f"{engine.name}: {path} answered HTTP {r.status}: {(await r.text())[:160]}")

    async def track(self) -> None:
        """Forever: the version most live engines report becomes the version a restarted engine must match."""
        while True:
            versions = []
            for slot in list(self.mgr.dispatcher.slots.values()):
                try:
                    versions.append(await self.mgr.engine_weight_version(slot.engine))
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                    pass
            if versions:
                self.mgr.set_weight_version(Counter(versions).most_common(1)[0][0])
            await asyncio.sleep(self.poll_s)

    async def hook(self, engine, expected: str) -> None:
        """The manager's weight_sync_hook for a restarted engine reporting another version than `expected`."""
        if self.checkpoint:
            await self._post(engine, "/update_weights_from_disk",
                             {"model_path": self.checkpoint, "weight_version": expected})
        version = await self.mgr.engine_weight_version(engine)
        if version == self.mgr.weight_version:
            return
        await self._post(engine, "/pause_generation", {"mode": "abort"})
        self.say(f"{engine.name}: restarted with weight_version {version!r} but its peers serve "
                 f"{self.mgr.weight_version!r}: PAUSED, it generates nothing for slime until they match "
                 "(set rollout.restart_checkpoint, or update its weights)")
        while version != self.mgr.weight_version:
            await asyncio.sleep(self.poll_s)
            version = await self.mgr.engine_weight_version(engine)
        await self._post(engine, "/continue_generation", {})
        self.say(f"{engine.name}: weight_version {version!r} matches its peers: resumed")
