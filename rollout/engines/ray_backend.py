"""Ray backend: one actor per engine, placed on its own placement group (as slime does).

The actor starts the SGLang server as a child process (argv, never a shell) that is SIGKILLed when
the actor dies (PR_SET_PDEATHSIG; SGLang's own children follow their launcher the same way), so
killing an actor leaves no orphan. `RayEngine` has the same interface as `lifecycle.Engine`.
Bundles: `gpus_per_engine` x {"GPU": 1, "CPU": 1} on GPU clusters, {"CPU": cpus_per_engine} on CPU.
"""
from __future__ import annotations

import signal
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.engines.lifecycle import EngineStartError, default_command


@ray.remote
class EngineActor:
    """Owns one SGLang server process on the node it was placed on."""

    def __init__(self, argv, env, log_path, host, port):
        from rollout.engines.lifecycle import ServerProcess, port_in_use
        if port_in_use(host, port):
            raise EngineStartError(f"port {port} on {host} is already taken")
        self.proc = ServerProcess(argv, env, log_path, die_with_parent=True)

    def pid(self) -> int:
        return self.proc.pid

    def returncode(self):
        return self.proc.returncode()

    def log_tail(self, n: int = 20) -> list:
        from rollout.engines.lifecycle import read_tail
        return read_tail(self.proc.log_path, n)

    def kill(self, sig: int) -> None:
        self.proc.kill(sig)

    def stop(self) -> list:
        self.proc.stop()
        return self.proc.leftover_pids()

    def leftover_pids(self) -> list:
        return self.proc.leftover_pids()


class RayEngine:
    backend = "ray"

    def __init__(self, spec, actor, pg, pid: int, log_path: str):
        self.spec, self.actor, self.pg, self.pid, self.log_path = spec, actor, pg, pid, log_path
        self._dead_reason = None
        self.started_at = time.monotonic()

    name = property(lambda self: self.spec.name)
    url = property(lambda self: self.spec.url)
    api_key = property(lambda self: self.spec.api_key)

    def _call(self, method, *args, timeout=5.0):
        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def alive(self) -> bool:
        if self._dead_reason:
            return False
        try:
            rc = self._call("returncode", timeout=5.0)
        except (RayActorError, RayTaskError) as e:
            self._dead_reason = f"Ray actor died ({type(e).__name__})"
            return False
        except GetTimeoutError:
            return True  # a slow answer is not a death; the health probes judge responsiveness
        if rc is not None:
            self._dead_reason = f"process exited with code {rc}" if rc >= 0 else \
                f"process killed by signal {signal.Signals(-rc).name}"
            return False
        return True

    def exit_reason(self) -> str:
        return self._dead_reason or ("process is running" if self.alive() else self._dead_reason)

    def log_tail(self, n: int = 20) -> list:
        try:
            return self._call("log_tail", n)
        except Exception:
            from rollout.engines.lifecycle import read_tail
            return read_tail(self.log_path, n)  # same node (local cluster)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self._call("kill", int(sig))

    def kill_actor(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def stop(self) -> None:
        try:
            self._call("stop", timeout=60.0)
        except Exception:
            pass
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass

    def leftover_pids(self) -> list:
        from rollout.engines.lifecycle import group_pids
        return group_pids(self.pid)  # local cluster: the engine ran on this node


class RayBackend:
    name = "ray"

    def __init__(self, log_dir: str, command=None, cpus_per_engine: float = 1, use_gpus: bool = False,
                 init_kwargs: dict | None = None, pg_timeout_s: float = 60.0):
        self.log_dir, self.command = log_dir, command or default_command
        self.cpus_per_engine, self.use_gpus, self.pg_timeout_s = cpus_per_engine, use_gpus, pg_timeout_s
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False, **(init_kwargs or {}))
            self._owns_ray = True
        self._starts: dict[str, int] = {}

    def bundles(self, spec) -> list:
        if self.use_gpus:
            return [{"GPU": 1, "CPU": 1}] * spec.group.gpus_per_engine
        return [{"CPU": self.cpus_per_engine}]

    def start(self, spec) -> RayEngine:
        import os
        argv, env = self.command(spec)
        k = self._starts.get(spec.name, 0)
        self._starts[spec.name] = k + 1
        log_path = os.path.join(self.log_dir, f"{spec.name}.log" if k == 0 else f"{spec.name}.restart{k}.log")
        pg = placement_group(self.bundles(spec), strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=self.pg_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise EngineStartError(f"engine {spec.name}: placement group {self.bundles(spec)} not placed "
                                   f"within {self.pg_timeout_s:g} s (cluster resources: {ray.cluster_resources()})")
        actor = EngineActor.options(
            num_cpus=0.01, num_gpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
        ).remote(argv, {k: str(v) for k, v in env.items()}, log_path, spec.host, spec.port)
        try:
            pid = ray.get(actor.pid.remote(), timeout=self.pg_timeout_s)
        except RayActorError as e:
            remove_placement_group(pg)
            cause = getattr(e, "cause", None) or e
            msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
            raise EngineStartError(f"engine {spec.name}: actor failed to start: {msg}") from None
        return RayEngine(spec, actor, pg, pid, log_path)

    def shutdown(self) -> None:
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
