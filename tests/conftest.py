"""Fixtures and hooks only: the tiny GLM-4.5 checkpoints, the engine pool, per-test budgets (helpers: tests/support/).

Engines are expensive (30-150 s to start on 2 cores) and memory-heavy, so one session-scoped
pool keeps at most one engine alive: asking for another configuration stops the current one
first (and checks by PID that its whole process tree is gone), and a slow/e2e test that does not
use the pool stops the pool's engine before it starts its own. Engines start as the product starts
them: a preset config's EngineSpec, the local backend, phased readiness.
"""
import pytest

from support import slime_standin
from support.engines import ENGINE_BUDGET_S, EnginePool

# pytest-timeout budgets (s). The default (pyproject: 300) covers tests without an engine; a test that
# starts real engines may pay one engine start (ENGINE_BUDGET_S) on top of its own work.
SLOW_TIMEOUT_S = int(ENGINE_BUDGET_S + 480)
E2E_TIMEOUT_S = int(ENGINE_BUDGET_S + 900)


def pytest_configure(config):
    """Where slime is not importable, its STAND-IN takes slime's module names (tests/support/slime_standin.py)."""
    slime_standin.install()


def pytest_collection_modifyitems(config, items):
    """Every slow/e2e test without its own `@pytest.mark.timeout(N)` gets the engine budget above."""
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
        elif item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_model():
    from rollout.models.tiny import build_tiny_glm

    return build_tiny_glm(variant="random")


@pytest.fixture(scope="session")
def tiny_match_model():
    from rollout.models.tiny import build_tiny_glm

    return build_tiny_glm(variant="always-match")


_POOLS = []  # the session's EnginePool, once some test asked for it


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    pool = EnginePool(str(tmp_path_factory.mktemp("engine-logs")))
    _POOLS.append(pool)
    yield pool
    pool.close()
    _POOLS.remove(pool)


@pytest.fixture(autouse=True)
def _no_idle_pool_engine_beside_other_engines(request):
    """A slow/e2e test that starts its own engines never runs beside the pool's idle engine:
    the pool's engine is stopped first (the next pool user starts it again)."""
    marked = request.node.get_closest_marker("slow") or request.node.get_closest_marker("e2e")
    if _POOLS and marked and "engine_pool" not in request.fixturenames:
        _POOLS[0].close()
    yield
