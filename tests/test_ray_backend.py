"""The Ray backend with a real local Ray cluster (`num_cpus=2`) and a real SGLang CPU engine in an
actor placed with a placement group: start, stream, kill the actor, recover, shut down clean.
Also the cross-process stream: a bounded Ray queue actor read by another process (backpressure)."""
import asyncio
import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from rollout import config as rconfig  # noqa: E402
from rollout.cli.engine import model_for  # noqa: E402
from rollout.engines.process import group_pids  # noqa: E402
from rollout.net import free_port  # noqa: E402
from rollout.manager import RolloutManager, group_record  # noqa: E402
from rollout.types import EngineEvent  # noqa: E402
from rollout.stream import GroupStream, RayGroupQueue  # noqa: E402

# e2e: a real engine in a Ray actor, killed and restarted (~3.5 min here); test_ray_placement stays in make test
pytestmark = [pytest.mark.slow, pytest.mark.e2e]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

READER = r"""
import json, sys, time, ray
from rollout.stream import RayGroupReader
ray.init(address=sys.argv[1], namespace="rollout-test", log_to_driver=False)
time.sleep(1.0)  # a slow trainer: the producer must wait, not drop
ids = [rec["group_id"] for rec in RayGroupReader("groups", timeout_s=300, namespace="rollout-test")]
print(json.dumps(ids))
"""


def _ray_pids():
    node = ray._private.worker._global_node
    return [p.process.pid for procs in node.all_processes.values() for p in procs]


def test_ray_backend_start_stream_kill_actor_recover_shutdown(tmp_path):
    from rollout.engines.ray_backend import RayBackend

    cfg = rconfig.load(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml"))
    cfg.engine_groups[0].engines = 1
    cfg.rollout.sampling.max_new_tokens = 8
    for k in ("http_s", "server_up_s"):
        setattr(cfg.rollout.budgets, k, 400.0)
    model = model_for(cfg, ROOT)
    backend = RayBackend(str(tmp_path), init_kwargs={"num_cpus": 2, "namespace": "rollout-test"})
    ray_pids = _ray_pids()
    mgr = RolloutManager.from_config(cfg, backend, model, ports=[free_port()])
    engines_seen = []

    async def go():
        await mgr.start()
        try:
            first = mgr.source.engines["tiny-0"]
            engines_seen.append(first)
            assert first.backend == "ray" and first.alive()
            # stream across processes: bounded Ray queue actor, a reader in another process
            from ray.util.queue import Queue
            q = Queue(maxsize=1, actor_options={"name": "groups", "num_cpus": 0})
            reader = await asyncio.create_subprocess_exec(
                sys.executable, "-c", READER, ray.get_runtime_context().gcs_address, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            sink = RayGroupQueue(queue=q, encode=group_record, timeout_s=120)
            res = await mgr.rollout([[5 + i, 6, 7, 8, 9] for i in range(3)], sink, batch_size=3)
            await sink.close()
            out, _ = await asyncio.wait_for(reader.communicate(), 300)
            import json
            ids = json.loads(out.decode().strip().splitlines()[-1])
            assert res.delivered == 3 and sorted(ids) == sorted(set(ids)) and len(ids) == 3
            # kill the actor: the engine process dies with it; the manager restarts a new actor
            t_kill = time.monotonic()
            first.kill_actor()
            while not mgr.count(EngineEvent.DEAD):
                await asyncio.sleep(0.05)
            print(f"death seen {time.monotonic() - t_kill:.2f} s after the kill", flush=True)
            # seen through the actor (the backend's poll), not after 3 failed health probes
            dead = next(e for e in mgr.events if e.kind == EngineEvent.DEAD)
            assert dead.detail.startswith("Ray actor died"), dead.detail
            while not mgr.count(EngineEvent.READMITTED):
                await asyncio.sleep(0.5)
            second = mgr.source.engines["tiny-0"]
            engines_seen.append(second)
            assert second is not first and second.alive()
            stream = GroupStream(8)
            res2 = await mgr.rollout([[20, 21, 22, 23]], stream, batch_size=1)
            await stream.close()
            g = [x async for x in stream][0]
            assert res2.delivered == 1 and all(s.engine == "tiny-0" for s in g.samples)
            assert mgr.dispatcher.slots["tiny-0"].engine is second
        finally:
            await mgr.stop()

    asyncio.run(go())
    assert not ray.is_initialized()
    time.sleep(1.0)
    for e in engines_seen:
        assert group_pids(e.pid) == [], f"engine {e.pid} left processes"
    left = [p for p in ray_pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert left == [], f"Ray processes left: {left}"
