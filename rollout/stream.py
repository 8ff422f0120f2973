"""Finished groups go to the trainer as they finish, exactly once, with backpressure and no drops.

`GroupStream`: in-process, bounded; `put()` waits while the consumer is behind; iterate with
`async for group in stream`, or run producer and consumer together with `pump` (a failing consumer stops
the producer). `RayGroupQueue`: the same across processes through a bounded Ray queue
actor (`ray.util.queue.Queue`); the trainer side reads it with `RayGroupReader`. Both refuse a
second delivery of a group id (the dedupe key), so a re-sent group can never reach the trainer twice.
The gate remembers the last `remember` group ids (and their sample ids), so a long `serve` run keeps
bounded memory: group ids are unique per run (`<run_id>-g<n>`) and a duplicate can only come from a
group still in flight, far inside that window.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import AsyncIterator, Iterator

_END = "__end_of_rollout__"


class Window:
    """A set that keeps only the `size` most recently added keys (bounded memory)."""

    def __init__(self, size: int):
        self.size = size
        self._keys: OrderedDict = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def discard(self, key) -> None:
        self._keys.pop(key, None)


class Once:
    """Exactly-once gate: a group passes only if neither its id nor any of its sample ids passed before."""

    def __init__(self, remember: int = 100_000):
        self.delivered = Window(remember)
        self.samples = Window(remember * 8)
        self.duplicates = 0

    def admit(self, group) -> bool:
        ids = [s.sample_id for s in group.samples]
        if group.group_id in self.delivered or len(set(ids)) != len(ids) or any(i in self.samples for i in ids):
            self.duplicates += 1
            return False
        self.delivered.add(group.group_id)
        for i in ids:
            self.samples.add(i)
        return True

    def forget(self, group) -> None:
        """Not delivered after all (e.g. the queue stayed full): it may be put again."""
        self.delivered.discard(group.group_id)
        for s in group.samples:
            self.samples.discard(s.sample_id)


class GroupStream(Once):
    def __init__(self, maxsize: int = 64, remember: int = 100_000):
        super().__init__(remember)
        self._q: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self._closed = False
        self.max_depth = 0

    async def put(self, group) -> bool:
        """Queue a finished group (waits while full); False, not queued, if it was delivered before."""
        if not self.admit(group):
            return False
        await self._q.put(group)
        self.max_depth = max(self.max_depth, self._q.qsize())
        return True

    async def close(self) -> None:
        """End the stream after what is queued; never waits (the consumer may be gone)."""
        self._closed = True
        if not self._q.full():
            self._q.put_nowait(_END)

    def __aiter__(self) -> AsyncIterator:
        return self._iter()

    async def _iter(self):
        while not (self._closed and self._q.empty()):
            item = await self._q.get()
            if isinstance(item, str) and item == _END:
                return
            yield item


async def pump(produce, stream: GroupStream, consume):
    """Run the coroutine `produce` (which puts groups into `stream`) while `await consume(group)` takes each
    one; returns what `produce` returns. The consumer's failure cancels the producer at once and is raised;
    on the producer's end or error (or a cancel from outside) the groups already queued are still consumed."""
    async def drain():
        async for group in stream:
            await consume(group)

    consumer = asyncio.create_task(drain())
    producer = asyncio.ensure_future(produce)
    try:
        await asyncio.wait({consumer, producer}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        producer.cancel()
        await asyncio.wait({producer})
        await stream.close()
        await asyncio.wait({consumer})
        if not consumer.cancelled():
            consumer.exception()             # retrieved: the cancel is what is raised
        raise
    if not producer.done():                  # the consumer failed: stop producing now
        producer.cancel()
        await asyncio.wait({producer})
        consumer.result()
    await stream.close()
    await consumer                           # what is queued is consumed; raises the consumer's error
    return producer.result()                 # raises the producer's error


class RayGroupQueue(Once):
    """Producer side of a bounded Ray queue actor; `encode` turns a group into what is sent
    (e.g. `rollout.manager.group_record`)."""

    def __init__(self, maxsize: int = 64, queue=None, encode=None, timeout_s: float | None = None):
        super().__init__()
        from ray.util.queue import Queue
        self.queue = queue if queue is not None else Queue(maxsize=maxsize)
        self.encode = encode or (lambda g: g)
        self.timeout_s = timeout_s  # None: wait as long as the trainer needs (backpressure)

    async def put(self, group) -> bool:
        from ray.util.queue import Full
        if not self.admit(group):
            return False
        try:  # waits while the queue is full
            await self.queue.put_async(self.encode(group), block=True, timeout=self.timeout_s)
        except Full:
            self.forget(group)
            raise RuntimeError(f"trainer queue stayed full for {self.timeout_s:g} s (consumer stalled?)") from None
        return True

    async def close(self) -> None:
        await self.queue.put_async(_END, block=True)


class RayGroupReader:
    """Trainer side, in any process of the cluster: iterate over the groups of a `RayGroupQueue`
    until the producer closes. `queue`: a `ray.util.queue.Queue`, its actor handle, or the actor's
    name (`namespace` then applies)."""

    def __init__(self, queue, timeout_s: float | None = None, namespace: str | None = None):
        import ray
        if isinstance(queue, str):
            queue = ray.get_actor(queue, namespace=namespace)
        self.actor = getattr(queue, "actor", queue)
        self.timeout_s = timeout_s
        self.seen = Window(100_000)

    def __iter__(self) -> Iterator:
        import ray
        while True:
            item = ray.get(self.actor.get.remote(self.timeout_s))
            if isinstance(item, str) and item == _END:
                return
            gid = item["group_id"] if isinstance(item, dict) else item.group_id
            if gid in self.seen:  # belt and braces: the producer already refuses duplicates
                continue
            self.seen.add(gid)
            yield item
