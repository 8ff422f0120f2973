"""The manager's bound on started groups' unfinished samples (rollout/inflight.py)."""
import asyncio

import pytest

from rollout.inflight import InFlight

pytestmark = pytest.mark.timeout(30)


def test_groups_enter_in_order_as_samples_leave_and_a_large_one_when_empty():
    async def go():
        gate, entered = InFlight(8), []

        async def group(name, n):
            await gate.enter(n)
            entered.append(name)
        await gate.enter(8)
        tasks = [asyncio.create_task(group(name, n)) for name, n in (("a", 4), ("b", 2), ("big", 12))]
        await asyncio.sleep(0)
        assert entered == []
        for _ in range(3):
            gate.leave(1)
        await asyncio.sleep(0)
        assert entered == []               # 5 + 4 > 8: "a" waits; "b" behind it waits too (in order)
        gate.leave(1)
        await asyncio.sleep(0)
        assert entered == ["a"] and gate.live == 8
        gate.leave(2)
        await asyncio.sleep(0)
        assert entered == ["a", "b"]
        gate.leave(8)                      # nothing in flight: the group larger than the bound enters
        await asyncio.gather(*tasks)
        return entered, gate.live
    assert asyncio.run(go()) == (["a", "b", "big"], 12)


def test_a_cancelled_waiter_gives_its_place_to_the_next():
    async def go():
        gate = InFlight(4)
        await gate.enter(3)
        first = asyncio.create_task(gate.enter(4))
        second = asyncio.create_task(gate.enter(1))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.wait_for(second, 1)  # 3 + 1 fits once the one ahead of it is gone
        return gate.live
    assert asyncio.run(go()) == 4
