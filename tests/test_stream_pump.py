"""`stream.pump`: a bounded stream between the rollout and the writer; a failing writer stops the producer
at once, and a closed stream ends after what is queued without ever blocking."""
import asyncio

import pytest

from rollout.stream import GroupStream, pump
from rollout.types import Group

pytestmark = pytest.mark.timeout(30)


def _groups(n):
    return [Group.fresh(f"r-g{i}", [1, 2], 1) for i in range(n)]


def test_a_failing_consumer_cancels_the_producer_at_once():
    put, written = [], []

    async def produce(stream):
        for g in _groups(100):
            await stream.put(g)       # blocks while the stream is full: the consumer sets the pace
            put.append(g.group_id)
        return "done"

    async def consume(group):
        if len(written) == 2:
            raise OSError(28, "No space left on device")
        written.append(group.group_id)

    async def scenario():
        stream = GroupStream(maxsize=2)
        with pytest.raises(OSError, match="No space left"):
            await pump(produce(stream), stream, consume)

    asyncio.run(scenario())
    assert written == ["r-g0", "r-g1"] and len(put) <= 6   # not the 100 a stream sized to the run takes


def test_producer_end_or_error_still_writes_what_is_queued():
    async def scenario(fail):
        stream, written = GroupStream(maxsize=4), []

        async def produce():
            for g in _groups(4):
                await stream.put(g)   # fills the stream: close() must not wait for room
            if fail:
                raise RuntimeError("every engine is lost")
            return 4

        async def consume(group):
            await asyncio.sleep(0)
            written.append(group.group_id)

        try:
            return await pump(produce(), stream, consume), written
        except RuntimeError as e:
            return str(e), written

    assert asyncio.run(scenario(False)) == (4, ["r-g0", "r-g1", "r-g2", "r-g3"])
    assert asyncio.run(scenario(True)) == ("every engine is lost", ["r-g0", "r-g1", "r-g2", "r-g3"])
