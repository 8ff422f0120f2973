"""Which groups may start: a bound on the samples of started groups that have not finished yet.

The manager starts a group while the unfinished samples of the groups it started stay within `limit`
(twice what the engines hold, so the engines never wait on a group's start); each sample leaves as it
finishes. A bound on groups instead let one long straggler per group hold every group's place: the
engines' slots idled until the stragglers ended (slime's rollout bounds requests, not groups). Groups
enter in order (first come, first served); one larger than `limit` enters when nothing is in flight.
"""
from __future__ import annotations

import asyncio
import collections
import math


def bound(concurrency: int, engines: int, group_size: int) -> int:
    """The manager's limit: twice the engines' slots, in whole groups."""
    return max(1, math.ceil(concurrency * engines / group_size)) * 2 * group_size


class InFlight:
    def __init__(self, limit: int):
        self.limit, self.live = max(1, int(limit)), 0
        self._waiting: collections.deque = collections.deque()   # (samples, future), in arrival order

    def _fits(self, n: int) -> bool:
        return self.live == 0 or self.live + n <= self.limit

    async def enter(self, n: int) -> None:
        """Wait until `n` more samples fit, then count them."""
        if not self._waiting and self._fits(n):
            self.live += n
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave(n)       # let in as it was cancelled: give the place back
            else:
                self._waiting.remove((n, fut))
                self.leave(0)       # the next in line may fit now
            raise

    def leave(self, n: int = 1) -> None:
        """`n` counted samples finished (or will not run): let the next groups in, in order."""
        self.live = max(0, self.live - n)
        while self._waiting and self._fits(self._waiting[0][0]):
            k, fut = self._waiting.popleft()
            if not fut.done():
                self.live += k
                fut.set_result(None)
