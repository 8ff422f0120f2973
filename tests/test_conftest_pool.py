"""The engine pool's engine is stopped before a slow test that starts its own engines (no real engine here:
a stand-in pool engine records the stop)."""
import pytest

import conftest
from support.engines import EnginePool


class _StandInEngine:
    def __init__(self):
        self.stopped = False

    def tree_pids(self):
        return []

    def stop(self):
        self.stopped = True
        return []


@pytest.fixture
def pool_with_engine(tmp_path):
    pool = EnginePool(str(tmp_path))
    pool.key, pool.engine = "x", _StandInEngine()
    conftest._POOLS.append(pool)
    yield pool
    conftest._POOLS.remove(pool)


def test_unmarked_test_keeps_the_pool_engine(pool_with_engine, request):
    eng = pool_with_engine.engine
    conftest._no_idle_pool_engine_beside_other_engines.__wrapped__(request).__next__()
    assert not eng.stopped and pool_with_engine.engine is eng


def test_slow_test_without_the_pool_stops_its_engine(pool_with_engine, request):
    eng = pool_with_engine.engine
    request.node.add_marker(pytest.mark.slow)
    conftest._no_idle_pool_engine_beside_other_engines.__wrapped__(request).__next__()
    assert eng.stopped and pool_with_engine.engine is None and pool_with_engine.stopped["x"] == ([], [])
