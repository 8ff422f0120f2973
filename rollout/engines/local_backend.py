"""The local backend: every node of an engine as a server child process of this one, on this machine."""
from __future__ import annotations

import signal
import sys
import time

from rollout.config import EngineSpec
from rollout.engines.base import Command, EngineStartError, describe_exit, log_name, node_commands
from rollout.engines.command import spec_commands
from rollout.engines.process import PortTaken, ServerProcess, clear_stale, read_tail


class LocalEngine:
    """Handle on one started engine whose node processes run on this machine."""

    backend = "local"

    def __init__(self, spec: EngineSpec, procs: list[ServerProcess]):
        self.spec = spec
        self.procs = procs
        self.started_at = time.monotonic()

    name = property(lambda self: self.spec.name)
    url = property(lambda self: self.spec.url)
    api_key = property(lambda self: self.spec.api_key)
    pid = property(lambda self: self.procs[0].pid)
    log_path = property(lambda self: self.procs[0].log_path)
    pids = property(lambda self: [p.pid for p in self.procs])

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def exit_reason(self) -> str:
        for rank, p in enumerate(self.procs):
            if not p.alive():
                where = f"node {rank}: " if len(self.procs) > 1 else ""
                return where + describe_exit(p.returncode())
        return "process is running"

    def log_tail(self, n: int = 20) -> list[str]:
        dead = [p for p in self.procs if not p.alive()]
        return read_tail((dead or self.procs)[0].log_path, n, secret=self.api_key)

    def kill(self, sig: int = signal.SIGKILL, node: int = 0) -> None:
        self.procs[node].kill(sig)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()

    def leftover_pids(self) -> list[int]:
        return [pid for p in self.procs for pid in p.leftover_pids()]

    def tree_pids(self) -> list[int]:
        """Every process of every node (main processes and their descendants)."""
        return [pid for p in self.procs for pid in p.tree_pids()]


class LocalBackend:
    """Engines as child processes of this one; every node of a multi-node engine on this machine."""

    name = "local"

    def __init__(self, log_dir: str, command: Command | None = None):
        self.log_dir = log_dir
        self.command = command or spec_commands
        self._starts: dict[str, int] = {}
        self.notes: list[str] = []  # stale engines found and killed

    def log_path(self, spec: EngineSpec) -> str:
        return log_name(self.log_dir, spec, self._starts.get(spec.name, 0))

    def start(self, spec: EngineSpec) -> LocalEngine:
        try:
            notes = clear_stale(spec.host, spec.port)
        except PortTaken as e:
            raise EngineStartError(str(e)) from None
        for n in notes:
            print(f"{spec.name}: {n}", file=sys.stderr, flush=True)
        self.notes += notes
        cmds = node_commands(self.command, spec)
        k = self._starts.get(spec.name, 0)
        self._starts[spec.name] = k + 1
        procs = []
        try:
            for c in cmds:
                procs.append(ServerProcess(c.argv, c.env, log_name(self.log_dir, spec, k, c.node_rank, len(cmds)),
                                           api_key=c.api_key, owner_port=spec.port))
        except OSError as e:
            for p in procs:
                p.stop()
            raise EngineStartError(f"cannot execute {cmds[0].argv[0]!r}: {e.strerror or e}") from None
        return LocalEngine(spec, procs)

    def shutdown(self) -> None:
        pass
