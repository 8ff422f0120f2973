"""One real SGLang CPU engine spanning two simulated Ray nodes (`ray.cluster_utils.Cluster`, each node
with one logical GPU): the engine's placement group of 2 x {"GPU": 1, "CPU": 1} bundles lands one
bundle per node, one actor per node starts that node's `launch_server --nnodes 2 --node-rank i` over
loopback. It is admitted after readiness, serves a rollout with routed experts, and on kill -9 of the
node-rank-1 process the engine is declared dead, both nodes are restarted together, and every group
arrives exactly once. Heavy (a Ray cluster + two engine processes on a 2-core machine): e2e."""
import asyncio
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from rollout import config as rconfig  # noqa: E402
from rollout.cli.engine import model_for  # noqa: E402
from rollout.engines.process import group_pids  # noqa: E402
from rollout.net import free_port  # noqa: E402
from rollout.manager import RolloutManager  # noqa: E402
from rollout.types import EngineEvent  # noqa: E402
from rollout.stream import GroupStream  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
    cfg = rconfig.load(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml"))
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = 2, 1
    g = cfg.engine_groups[0]
    g.engines, g.gpus_per_engine, g.tp = 1, 2, 2  # one engine, tp 2 over 2 nodes
    cfg.rollout.sampling.max_new_tokens = 8
    cfg.rollout.health.interval_s = 1.0
    for k in ("http_s", "server_up_s", "health_generate_s"):
        setattr(cfg.rollout.budgets, k, 600.0)
    return cfg


def _prompts(n, length=12):
    return [[(7 * i + j) % 290 + 5 for j in range(length)] for i in range(n)]


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=c.address, log_to_driver=False, namespace="multinode-test")
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.mark.timeout(1500)
def test_two_node_engine_serves_and_restarts_whole_on_node1_kill(cluster, tmp_path):
    from rollout.engines.ray_backend import RayBackend

    cfg = _config()
    model = model_for(cfg, ROOT)
    backend = RayBackend(str(tmp_path))
    mgr = RolloutManager.from_config(cfg, backend, model, ports=[free_port()])
    seen = []

    async def go():
        t0 = time.monotonic()
        await mgr.start()
        print(f"2-node engine admitted after {time.monotonic() - t0:.1f} s", flush=True)
        try:
            old = mgr.source.engines["tiny-0"]
            seen.append(old)
            assert old.backend == "ray" and len(old.pids) == 2 and len(set(old.node_ids)) == 2
            assert [b for b in ray.util.placement_group_table(old.pg)["bundles"].values()] == \
                [{"GPU": 1.0, "CPU": 1.0}] * 2
            stream = GroupStream(maxsize=64)
            res = await mgr.rollout(_prompts(2), stream, batch_size=2)
            await stream.close()
            groups = [g async for g in stream]
            assert res.delivered == 2
            for g in groups:
                for s in g.samples:
                    assert s.status in ("completed", "truncated"), s.error
                    assert s.routed_experts.shape == (len(s.tokens) - 1, 2, 4)
            # kill -9 node rank 1 mid-rollout: the whole engine dies and restarts, no group twice
            mgr.dispatcher.sampling["max_new_tokens"] = 128
            stream = GroupStream(maxsize=64)
            task = asyncio.create_task(mgr.rollout(_prompts(4), stream, batch_size=4))
            while not any(s.outstanding for s in mgr.dispatcher.slots.values()):
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            os.kill(old.pids[1], signal.SIGKILL)
            t_kill = time.monotonic()
            while not mgr.count(EngineEvent.DEAD):
                await asyncio.sleep(0.05)
            dead_s = time.monotonic() - t_kill
            res = await asyncio.wait_for(task, timeout=900)
            await stream.close()
            groups = [g async for g in stream]
            new = mgr.source.engines["tiny-0"]
            seen.append(new)
            return res, groups, dead_s, old, new
        finally:
            await mgr.stop()

    res, groups, dead_s, old, new = asyncio.run(go())
    dead = [e.detail for e in mgr.events if e.kind == EngineEvent.DEAD]
    print(f"death seen after {dead_s:.2f} s: {dead[0]}", flush=True)
    assert dead[0].startswith("node 1: process killed by signal SIGKILL")  # not after failed health probes
    assert res.delivered == 4 and len({g.group_id for g in groups}) == 4 and res.resent >= 1
    assert new is not old and not set(new.pids) & set(old.pids)
    assert mgr.count(EngineEvent.READMITTED)
    for e in seen:  # node 0 was stopped with node 1; nothing of either start is left
        assert [p for pid in e.pids for p in group_pids(pid)] == []
