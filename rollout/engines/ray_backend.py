"""The Ray backend: one placement group per engine, one actor per node of the engine.

Bundles are `gpus_per_engine` x {"GPU": 1, "CPU": 1} (a CPU engine of one node: {"CPU": n}), placed
with PACK and grouped by the node Ray put them on; each node of the engine gets one `NodeActor` on its
first bundle, which starts that node's SGLang server (argv from the one command builder, with the
node's address and the GPU ids Ray assigned to its bundles) as a child that is SIGKILLed when the actor
dies. Node 0 serves HTTP. The death of any node's process or actor is the death of the engine: the
manager stops every node and starts them all again. `alive()` never blocks: each actor holds a
`wait_exit()` call that returns when its server exits (or fails when the actor dies), and `alive()`
only asks Ray whether one of those answers has arrived. Actors receive only the engine's own env.
"""
from __future__ import annotations

import os
import signal
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.engines.command import spec_commands
from rollout.engines.base import EngineStartError, describe_exit, log_name, node_commands
from rollout.engines.process import group_pids, read_tail


@ray.remote(max_concurrency=4)
class NodeActor:
    """Owns one node's SGLang server process on the node it was placed on."""

    def __init__(self, argv, env, log_path, api_key, port, check_port, drop_env):
        from rollout.engines.process import ServerProcess, clear_stale
        if check_port:
            clear_stale(check_port[0], port)
        for k in drop_env:
            os.environ.pop(k, None)
        self.proc = ServerProcess(argv, env, log_path, api_key=api_key, owner_port=port)

    def pid(self) -> int:
        return self.proc.pid

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def wait_exit(self):
        while self.proc.alive():
            time.sleep(0.2)
        return self.proc.returncode()

    def log_tail(self, n: int = 20) -> list:
        return read_tail(self.proc.log_path, n)

    def kill(self, sig: int) -> None:
        self.proc.kill(sig)

    def stop(self) -> list:
        self.proc.stop()
        return self.proc.leftover_pids()


@ray.remote(num_cpus=0, num_gpus=1)
def _bundle_gpu():
    return [int(g) for g in ray.get_gpu_ids()]


class RayEngine:
    backend = "ray"

    def __init__(self, spec, actors, pg, pids, log_paths, url):
        self.spec, self.actors, self.pg, self.pids, self.log_paths = spec, actors, pg, pids, log_paths
        self.url = url
        self._watch = {a.wait_exit.remote(): rank for rank, a in enumerate(actors)}
        self._dead_reason = None
        self.started_at = time.monotonic()

    name = property(lambda self: self.spec.name)
    api_key = property(lambda self: self.spec.api_key)
    pid = property(lambda self: self.pids[0])
    log_path = property(lambda self: self.log_paths[0])

    def alive(self) -> bool:
        """Never blocks: has any node's exit (or actor death) been reported?"""
        if self._dead_reason:
            return False
        ready, _ = ray.wait(list(self._watch), num_returns=1, timeout=0)
        if not ready:
            return True
        rank = self._watch[ready[0]]
        where = f"node {rank}: " if len(self.actors) > 1 else ""
        try:
            self._dead_reason = where + describe_exit(ray.get(ready[0], timeout=1))
        except (RayActorError, RayTaskError) as e:
            self._dead_reason = where + f"Ray actor died ({type(e).__name__})"
        except GetTimeoutError:
            return True
        return False

    def exit_reason(self) -> str:
        return self._dead_reason if not self.alive() else "process is running"

    def log_tail(self, n: int = 20) -> list:
        for p in self.log_paths:
            if os.path.exists(p):  # same machine (a local or simulated cluster)
                return read_tail(p, n, secret=self.api_key)
        try:
            return [ln.replace(self.api_key, "***") if self.api_key else ln
                    for ln in ray.get(self.actors[0].log_tail.remote(n), timeout=2)]
        except Exception:
            return []

    def kill(self, sig: int = signal.SIGKILL, node: int = 0) -> None:
        ray.get(self.actors[node].kill.remote(int(sig)), timeout=10)

    def kill_actor(self, node: int = 0) -> None:
        ray.kill(self.actors[node], no_restart=True)

    def stop(self) -> None:
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=60)
        except Exception:
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass

    def leftover_pids(self) -> list:
        return [p for pid in self.pids for p in group_pids(pid)]  # local cluster: same machine


class RayBackend:
    name = "ray"

    def __init__(self, log_dir: str, command=None, cpus_per_engine: float = 1, use_gpus: bool | None = None,
                 init_kwargs: dict | None = None, pg_timeout_s: float = 60.0):
        self.log_dir, self.command = log_dir, command
        self.cpus_per_engine, self.use_gpus, self.pg_timeout_s = cpus_per_engine, use_gpus, pg_timeout_s
        self._owns_ray = False
        if not ray.is_initialized():
            if init_kwargs is None:  # RAY_ADDRESS set: join that cluster as it is; else a local one sized to this machine
                init_kwargs = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(2, os.cpu_count() or 2)}
            ray.init(include_dashboard=False, log_to_driver=False, **init_kwargs)
            self._owns_ray = True
        self._starts: dict[str, int] = {}

    def gpu_bundles(self, spec) -> bool:
        if self.use_gpus is not None:
            return self.use_gpus
        return spec.device == "cuda" or spec.nnodes > 1

    def bundles(self, spec) -> list:
        if self.gpu_bundles(spec):
            return [{"GPU": 1, "CPU": 1} for _ in range(spec.group.gpus_per_engine)]
        return [{"CPU": self.cpus_per_engine}]

    def _place(self, spec):
        """Place the engine's placement group -> (pg, [bundle indexes per node], [address per node],
        [GPU ids per node] or None, [Ray node id per node]), node 0 first."""
        bundles = self.bundles(spec)
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=self.pg_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise EngineStartError(f"engine {spec.name}: placement group of {len(bundles)} x {bundles[0]} not "
                                   f"placed within {self.pg_timeout_s:g} s (cluster: {ray.cluster_resources()})")
        by_node: dict[str, list[int]] = {}
        for idx, node in sorted(placement_group_table(pg)["bundles_to_node_id"].items()):
            by_node.setdefault(node, []).append(int(idx))
        groups = list(by_node.values())
        if len(groups) != spec.nnodes or len({len(g) for g in groups}) != 1:
            remove_placement_group(pg)
            raise EngineStartError(f"engine {spec.name}: needs {spec.nnodes} node(s) with the same number of "
                                   f"GPUs, Ray placed its bundles as {[len(g) for g in groups]}")
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        here = ray.get_runtime_context().get_node_id()
        hosts = [ips[node] for node in by_node]
        if all(ip == ips.get(here) for ip in hosts):
            hosts = [spec.host] * len(groups)  # one machine (a local or simulated cluster): the config's address
        gpus = None
        if self.gpu_bundles(spec):
            refs = [[_bundle_gpu.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i)).remote() for i in g] for g in groups]
            gpus = [sorted(x for ids in ray.get(r, timeout=self.pg_timeout_s) for x in ids) for r in refs]
        return pg, groups, hosts, gpus, list(by_node)

    def start(self, spec) -> RayEngine:
        k = self._starts.get(spec.name, 0)
        self._starts[spec.name] = k + 1
        pg, groups, hosts, gpus, node_ids = self._place(spec)
        cmds = node_commands(self.command, spec) if self.command else spec_commands(spec, hosts, gpus)
        actors, logs = [], []
        for c, g in zip(cmds, groups):
            log = log_name(self.log_dir, spec, k, c.node_rank, len(cmds))
            drop = ["CUDA_VISIBLE_DEVICES"] if spec.device == "cuda" and "CUDA_VISIBLE_DEVICES" not in c.env else []
            actors.append(NodeActor.options(
                num_cpus=0.01, num_gpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=g[0], placement_group_capture_child_tasks=True),
            ).remote(c.argv, {a: str(b) for a, b in c.env.items()}, log, c.api_key, c.port,
                     [c.host] if c.node_rank == 0 else None, drop))
            logs.append(log)
        try:
            pids = ray.get([a.pid.remote() for a in actors], timeout=self.pg_timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            for a in actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(pg)
            cause = getattr(e, "cause", None) or e
            msg = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
            raise EngineStartError(f"engine {spec.name}: actor failed to start: {msg}") from None
        engine = RayEngine(spec, actors, pg, pids, logs, f"http://{hosts[0]}:{spec.port}")
        engine.node_ids = node_ids  # the Ray node of each node of the engine
        return engine

    def shutdown(self) -> None:
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
