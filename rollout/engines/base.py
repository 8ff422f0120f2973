"""What every engine answers: the `Engine` protocol, the start error, and helpers both backends share.

Two kinds of engine answer it: `local_backend.LocalEngine` (server processes on this machine, one per
node of the engine) and `ray_backend.RayEngine` (one Ray actor per node of the engine, placed with one
placement group). An engine of several nodes lives and dies as one: the death of any node is the
death of the engine, and the manager restarts all its nodes together. A backend (`LocalBackend`, `RayBackend`)
starts an `EngineSpec` from the one command builder (`rollout.engines.command.spec_commands`; tests
may pass their own `command(spec)`); `rollout.engines.readiness` admits it.
"""
from __future__ import annotations

import importlib
import os
import signal
from typing import Callable, Optional, Protocol, runtime_checkable

from rollout.config import EngineSpec
from rollout.engines.command import NodeCommand

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
    def log_tail(self, n: int = 20) -> list[str]: ...   # last lines of the log, the API key masked
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


def log_name(log_dir: str, spec: EngineSpec, start: int, node: int = 0, nnodes: int = 1) -> str:
    stem = spec.name + (f".node{node}" if nnodes > 1 else "")
    return os.path.join(log_dir, f"{stem}.log" if start == 0 else f"{stem}.restart{start}.log")


# `--backend` name -> the backend's class, imported only when chosen (Ray is heavy)
BACKENDS = {"local": "rollout.engines.local_backend:LocalBackend",
            "ray": "rollout.engines.ray_backend:RayBackend"}


def backend_class(kind: str) -> type:
    module, name = BACKENDS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def open_backend(kind: str, log_dir: str):
    """The backend named `kind`, its engines logging under log_dir."""
    return backend_class(kind)(log_dir)
