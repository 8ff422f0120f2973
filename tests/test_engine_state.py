"""Engine state has one owner: the pool's `EngineTable` (rollout/engines/state.py).

Dispatch books slots in it, placement learns ranks from its admit/remove events, the health monitor watches
what it admits and stops when it removes, the sources read which engines are admitted from it. No engine runs
here: the table, the dispatcher and placement are driven by hand; a fleet's monitor is wired as `open` wires it.
"""
import asyncio
from types import SimpleNamespace

import pytest

from rollout.dispatch import Dispatcher
from rollout.engines.health import HealthMonitor
from rollout.engines.state import EngineTable
from rollout.placement import Placement

pytestmark = pytest.mark.timeout(30)


def _eng(name):
    return SimpleNamespace(name=name, url="http://127.0.0.1:1", api_key=None)


def test_dispatcher_slots_and_placement_ranks_follow_the_one_table():
    async def main():
        p = Placement(4, 8)
        d = Dispatcher(None, {"max_new_tokens": 4}, 8, placement=p)
        e0, e1 = _eng("e0"), _eng("e1")
        await d.admit(e0, "v1", dp_ranks=2)
        await d.admit(e1, None)
        assert d.slots is d.engines.slots and set(d.engines.slots) == {"e0", "e1"}
        assert d.engines.slots["e0"].dp_ranks == 2 and d.engines.slots["e0"].version == "v1"
        assert set(p.ranks) == {("e0", 0), ("e0", 1), ("e1", 0)}          # told by the table's admit event
        assert p.rank_param(("e0", 1)) == 1 and p.rank_param(("e1", 0)) is None
        assert await d.remove(e0) == 0
        assert set(d.engines.slots) == {"e1"} and set(p.ranks) == {("e1", 0)}   # and by its remove event
        await d.close("gone")
        assert d.closed_reason == "gone" == d.engines.closed_reason
        await d.reopen()
        assert d.closed_reason is None
    asyncio.run(main())


def test_a_stale_engine_object_does_not_remove_its_restarted_successor():
    t, removed = EngineTable(), []
    t.listen(removed=lambda e: removed.append(e.engine))
    old, new = _eng("e0"), _eng("e0")
    t.admit(old, 4)
    t.admit(new, 4)                       # restarted under the same name
    assert t.remove(old) is None and removed == [] and t.slots["e0"].engine is new
    assert t.remove(new).engine is new and removed == [new] and not t.slots


def test_the_monitor_watches_what_the_table_admits_and_stops_when_it_removes():
    t = EngineTable()
    m = HealthMonitor(None, None, interval_s=1.0, failures=1)
    t.listen(admitted=lambda e: m.watch(e.engine), removed=lambda e: m.unwatch(e.engine))   # as ManagedFleet.open
    e = _eng("e0")
    t.admit(e, 4)
    assert m.watches(e)
    t.remove(e)
    assert not m.watches(e) and not m.watched
