"""Engine lifecycle: the `Engine` protocol and the local backend.

Three kinds of engine answer the same protocol: `LocalEngine` (server processes on this machine, one
per node of the engine), `rollout.engines.ray_backend.RayEngine` (one Ray actor per node of the engine,
placed with one placement group) and `AttachedEngine` (an endpoint someone else started; never
killed). An engine of several nodes lives and dies as one: the death of any node is the death of the
engine, and the manager restarts all its nodes together. Commands come from
`rollout.engines.command.spec_commands` (tests may pass their own `command(spec)`).
"""
from __future__ import annotations

import signal
import sys
import time
from typing import Callable, Optional, Protocol, runtime_checkable

from rollout.config import EngineSpec
from rollout.engines.command import NodeCommand, spec_commands
from rollout.engines.process import ServerProcess, clear_stale, group_pids, port_in_use, read_tail  # noqa: F401

# spec -> every node's NodeCommand, or (argv, env) for a single-node engine
Command = Callable[[EngineSpec], "list[NodeCommand] | tuple[list[str], dict[str, str]]"]


class EngineStartError(RuntimeError):
    """The engine could not be launched at all (one line)."""


@runtime_checkable
class Engine(Protocol):
    name: str
    url: str
    api_key: Optional[str]
    backend: str

    def alive(self) -> bool: ...            # never blocks
    def exit_reason(self) -> str: ...
    def log_tail(self, n: int = 20) -> list[str]: ...
    def kill(self, sig: int = signal.SIGKILL) -> None: ...  # node 0's main process (a crash)
    def stop(self) -> None: ...             # every node, the whole tree
    def leftover_pids(self) -> list[int]: ...


def node_commands(command: Command, spec: EngineSpec) -> list[NodeCommand]:
    out = command(spec)
    if isinstance(out, tuple):
        argv, env = out
        return [NodeCommand(spec.name, 0, 1, spec.host, spec.port, list(argv), dict(env))]
    return list(out)


def describe_exit(rc: Optional[int]) -> str:
    if rc is None:
        return "process is running"
    if rc < 0:
        return f"process killed by signal {signal.Signals(-rc).name}"
    return f"process exited with code {rc}"


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


class AttachedEngine:
    """An endpoint started elsewhere (e.g. behind slime's router): probed, never started or killed."""

    backend = "attached"

    def __init__(self, name: str, url: str, api_key: Optional[str] = None):
        self.name, self.url, self.api_key = name, url, api_key

    def alive(self) -> bool:
        return True  # only the health probes can tell

    def exit_reason(self) -> str:
        return "attached endpoint (not ours to watch)"

    def log_tail(self, n: int = 20) -> list[str]:
        return []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        pass

    def stop(self) -> None:
        pass

    def leftover_pids(self) -> list[int]:
        return []


def log_name(log_dir: str, spec: EngineSpec, start: int, node: int = 0, nnodes: int = 1) -> str:
    import os
    stem = spec.name + (f".node{node}" if nnodes > 1 else "")
    return os.path.join(log_dir, f"{stem}.log" if start == 0 else f"{stem}.restart{start}.log")


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
        except RuntimeError as e:
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
