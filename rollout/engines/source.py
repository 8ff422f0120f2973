"""Which engines exist: an engine source, picked by one factory (`manager.engine_source`).

A source admits engines to a pool (the dispatcher: `admit`, `enlist`, `remove`, `close`, `reopen`, `client`)
and takes them out again; which are admitted it reads in the pool's engine table (`pool.engines`,
`engines.state`); the manager only dispatches and carries groups.
- `fleet.ManagedFleet`: engines this process launches (a backend), admits after phased readiness,
  watches (health monitor) and restarts.
- `attached.AttachedWorkers`: engines someone else started, at fixed endpoints or as a `discover`
  call lists them now (slime's router); re-listed by `relist()` and after a connection error.
"""
from __future__ import annotations

from typing import Optional

from rollout.types import EventLog


class EngineSource:
    """The part every source shares: its event log, the weight version restarted engines must report,
    and no-ops for what only one kind does."""

    def __init__(self, max_events: int = 10000):
        self.events = EventLog(max_events)
        self.weight_version: Optional[str] = None   # set after every weight update (restarts must match)
        self.abort_to: Optional[list] = None        # engines to abort on when a batch is full (None: admitted)

    @property
    def planned(self) -> int:
        """Engines the rollout may plan for before any is admitted (0: as many as are admitted)."""
        return 0

    async def open(self, pool) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Stop what was started (nothing, for engines started elsewhere)."""

    async def relist(self, max_age_s: float = 0.0, wait_s: Optional[float] = None) -> None:
        """Follow engines that come and go (only attached workers with `discover` do)."""

    async def on_error(self, engine) -> None:
        """A request to `engine` failed at the connection level."""

