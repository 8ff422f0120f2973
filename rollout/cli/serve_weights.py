"""Managed mode: a restarted engine must not serve slime off-policy.

A restarted engine has the base checkpoint's weights and is outside slime's weight-update group; slime's
external mode does not resync it, and `serve` does not know slime's router (which still routes to the
engine's address). So `serve`:
- tracks the weight version its live engines report (`/model_info`) as the manager's expected version;
- before re-admitting a restarted engine whose version differs: loads `rollout.restart_checkpoint` if set
  (`EngineClient.update_weights`: a retract-mode pause, flush, `/update_weights_from_disk` with the expected
  version, which loads the draft model too and needs no session on any release, the version published without
  aborting, continue: requests slime's router sent it meanwhile resume under those weights); if the version
  still differs, pauses the
  engine (`/pause_generation`), says so on stderr, and resumes it (`/continue_generation`) only once its
  version equals its peers'.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Optional

from rollout.errors import EngineError


class WeightGuard:
    """`hook` is the fleet's weight_sync_hook; `track(mgr)` keeps the expected version (`expected`) current."""

    def __init__(self, client, checkpoint, say, poll_s: float = 2.0):
        self.client, self.checkpoint, self.say, self.poll_s = client, checkpoint, say, poll_s
        self.expected: Optional[str] = None

    async def track(self, mgr) -> None:
        """Forever: the version most live engines report becomes the version a restarted engine must match."""
        while True:
            versions = []
            for slot in list(mgr.dispatcher.slots.values()):
                try:
                    versions.append(await self.client.weight_version(slot.engine))
                except EngineError:
                    pass
            if versions:
                self.expected = Counter(versions).most_common(1)[0][0]
                mgr.set_weight_version(self.expected)
            await asyncio.sleep(self.poll_s)

    async def hook(self, engine, expected: str) -> None:
        """For a restarted engine reporting another version than `expected` (then whatever `track` sees)."""
        self.expected = expected
        if self.checkpoint:
            await self.client.update_weights(
                engine, lambda: self.client.update_weights_from_disk(engine, self.checkpoint, expected), expected,
                path="disk")
        version = await self.client.weight_version(engine)
        if version == self.expected:
            return
        await self.client.pause_generation(engine, "abort")
        self.say(f"{engine.name}: restarted with weight_version {version!r} but its peers serve "
                 f"{self.expected!r}: PAUSED, it generates nothing for slime until they match "
                 "(set rollout.restart_checkpoint, or update its weights)")
        while version != self.expected:
            await asyncio.sleep(self.poll_s)
            version = await self.client.weight_version(engine)
        await self.client.continue_generation(engine)
        self.say(f"{engine.name}: weight_version {version!r} matches its peers: resumed")
