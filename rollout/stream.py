"""Finished groups go to the trainer as they finish, exactly once, with backpressure and no drops.

`GroupStream`: in-process, bounded; `put()` waits while the consumer is behind; iterate with
`async for group in stream`. `RayGroupQueue`: the same across processes through a bounded Ray queue
actor (`ray.util.queue.Queue`); the trainer side reads it with `RayGroupReader`. Both refuse a
second delivery of a group id (the dedupe key), so a re-sent group can never reach the trainer twice.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator

_END = "__end_of_rollout__"


class GroupStream:
    def __init__(self, maxsize: int = 64):
        self._q: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.delivered: set[str] = set()
        self.duplicates = 0
        self.max_depth = 0

    async def put(self, group) -> bool:
        """Queue a finished group; False (and not queued) if its id was already delivered."""
        if group.group_id in self.delivered:
            self.duplicates += 1
            return False
        self.delivered.add(group.group_id)
        await self._q.put(group)
        self.max_depth = max(self.max_depth, self._q.qsize())
        return True

    async def close(self) -> None:
        await self._q.put(_END)

    def __aiter__(self) -> AsyncIterator:
        return self._iter()

    async def _iter(self):
        while True:
            item = await self._q.get()
            if isinstance(item, str) and item == _END:
                return
            yield item


class RayGroupQueue:
    """Producer side of a bounded Ray queue actor. Items are plain dicts (see `to_record`)."""

    def __init__(self, maxsize: int = 64, queue=None, encode=None):
        from ray.util.queue import Queue
        self.queue = queue if queue is not None else Queue(maxsize=maxsize)
        self.encode = encode or (lambda g: g)
        self.delivered: set[str] = set()
        self.duplicates = 0

    async def put(self, group) -> bool:
        if group.group_id in self.delivered:
            self.duplicates += 1
            return False
        self.delivered.add(group.group_id)
        await self.queue.put_async(self.encode(group), block=True)  # waits while the queue is full
        return True

    async def close(self) -> None:
        await self.queue.put_async(_END, block=True)


class RayGroupReader:
    """Trainer side: iterate over the groups of a `RayGroupQueue` (blocking), until the producer closes."""

    def __init__(self, queue, timeout_s: float | None = None):
        self.queue, self.timeout_s = queue, timeout_s
        self.seen: set[str] = set()

    def __iter__(self) -> Iterator:
        while True:
            item = self.queue.get(block=True, timeout=self.timeout_s)
            if isinstance(item, str) and item == _END:
                return
            gid = item["group_id"] if isinstance(item, dict) else item.group_id
            if gid in self.seen:  # belt and braces: the producer already refuses duplicates
                continue
            self.seen.add(gid)
            yield item
