"""Ray placement across simulated nodes with STAND-IN servers (no SGLang): a real `ray.cluster_utils.Cluster`
of 2 nodes x 2 logical GPUs; one engine of gpus_per_engine 4 over 2 nodes gets one placement group of
4 x {"GPU": 1, "CPU": 1}, one actor per node with that node's address, GPU ids and node rank in its
command and only the engine's env; alive() asks Ray nothing that can block; the death of node 1's process is the engine's death
and stop() removes every node. The same with real SGLang is tests/test_engine_multinode.py (e2e)."""
import os
import signal
import sys
import time
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

from rollout.config import EngineSpec  # noqa: E402
from rollout.engines.command import spec_commands  # noqa: E402
from rollout.net import free_port  # noqa: E402
from rollout.engines.process import group_pids  # noqa: E402
from training_configs.schema import EngineGroup  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_readiness.py")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.mark.timeout(300)
def test_one_pg_per_engine_one_actor_per_node_any_node_death_kills_engine(cluster, tmp_path, monkeypatch):
    from rollout.engines.ray_backend import RayBackend

    g = EngineGroup(name="e", engines=1, gpus_per_engine=4, tp=4)
    spec = EngineSpec("e-0", g, 0, "127.0.0.1", free_port(), "k", "/m", device="cuda", gpus_per_node=2)
    seen = {}

    def command(s):  # the real per-node commands, the server swapped for the stand-in
        cmds = spec_commands(s)
        seen["cmds"] = cmds
        return [replace(c, argv=[sys.executable, STANDIN, "ok", str(c.port)]) for c in cmds]

    backend = RayBackend(str(tmp_path), command=command)
    # placement first, as start() does, to check what the real commands get from it
    pg, groups, hosts, gpus, _ = backend._place(spec)
    assert [len(x) for x in groups] == [2, 2] and gpus == [[0, 1], [0, 1]] and hosts == ["127.0.0.1"] * 2
    assert list(ray.util.placement_group_table(pg)["bundles"].values()) == [{"GPU": 1.0, "CPU": 1.0}] * 4
    ray.util.remove_placement_group(pg)
    real = spec_commands(spec, hosts, gpus)
    assert [c.argv[c.argv.index("--node-rank") + 1] for c in real] == ["0", "1"]
    assert all("--nnodes" in c.argv and c.argv[c.argv.index("--base-gpu-id") + 1] == "0" for c in real)

    monkeypatch.setenv("SMR_DRIVER_ONLY", "1")  # in the driver's environment only
    eng = backend.start(spec)
    try:
        for pid in eng.pids:  # the actors ship the engine's env, not the driver's os.environ
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert b"PYTHONUNBUFFERED=1" in env and not [e for e in env if e.startswith(b"SMR_DRIVER_ONLY=")]
        assert len(eng.actors) == 2 and len(set(eng.node_ids)) == 2 and len(eng.pids) == 2
        calls = []
        monkeypatch.setattr(ray, "get", lambda *a, **k: calls.append(a) or pytest.fail("blocking ray.get"))
        assert eng.alive() and calls == []  # a live engine: alive() only polls ray.wait(timeout=0)
        monkeypatch.undo()
        os.kill(eng.pids[1], signal.SIGKILL)
        end = time.monotonic() + 30
        while eng.alive():
            assert time.monotonic() < end, "node 1's death not seen"
            time.sleep(0.1)
        assert eng.exit_reason() == "node 1: process killed by signal SIGKILL"
    finally:
        eng.stop()
    assert [p for pid in eng.pids for p in group_pids(pid)] == []
    assert ray.util.placement_group_table(eng.pg)["state"] == "REMOVED"
