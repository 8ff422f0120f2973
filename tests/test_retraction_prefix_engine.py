"""A request retracted by a weight-update pause re-prefills with its kept routes, not another request's cached
prefix (a real SGLang 0.5.23 CPU engine, the near-tie model, routed experts, the plugin on).

One engine runs one request at a time (`max_running_requests: 1`). A is decoding, B (the same prompt) waits; the
update pauses in retract mode (A keeps its rows), loads another checkpoint (seed 1), continues. B prefills first
under the new weights with its own routes and caches the prompt; then A re-prefills. Without its own radix
namespace (`retraction-routes`, AFTER `release_req`) A reused B's cached prompt, so no plan forced those positions:
A's evidence counted 384 of 570 kept token-layer rows the re-prefill routed elsewhere. With it: 0. The same
defect on every release's own code: sglang_patches/scenarios/retraction.py (`retraction_routes_own_prefix`).
"""
import asyncio
import json
import os
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 128   # tokens per request (min_new_tokens: A is still decoding when B arrives)
PROMPT = 96


async def _scenario(model, other):
    import aiohttp

    from rollout import config as rconfig
    from rollout.engines.local_backend import LocalBackend
    from rollout.manager import RolloutManager
    from rollout.net import free_port

    cfg = rconfig.load(os.path.join(ROOT, "training_configs", "near-tie-cpu.yaml"))
    cfg.rollout.budgets.http_s = cfg.rollout.budgets.server_up_s = 600.0
    cfg.engine_groups[0].max_running_requests = 1
    mgr = RolloutManager.from_config(cfg, LocalBackend(tempfile.mkdtemp(prefix="own-prefix-")), model,
                                     ports=[free_port(cfg.rollout.host)])
    await mgr.start()
    engine = list(mgr.dispatcher.slots.values())[0].engine
    url = engine.url
    prompt = [3 + (i * 37) % 290 for i in range(PROMPT)]
    body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": N, "min_new_tokens": N, "temperature": 1.0}}
    done = []
    try:
        async with aiohttp.ClientSession() as s:
            async def stream_a(started):
                async with s.post(url + "/generate", json={**body, "stream": True}) as r:
                    last = None
                    async for line in r.content:
                        text = line.decode().strip()
                        if text.startswith("data:") and text != "data: [DONE]":
                            last = json.loads(text[5:])
                            started.set()
                done.append("A")
                return last

            async def gen_b():
                async with s.post(url + "/generate", json=body) as r:
                    out = await r.json()
                done.append("B")
                return out

            started = asyncio.Event()
            ta = asyncio.create_task(stream_a(started))
            await asyncio.wait_for(started.wait(), 300)     # A decodes
            tb = asyncio.create_task(gen_b())
            end = time.monotonic() + 120                    # B waits in the queue (one request at a time)
            while sum(x.get("num_waiting_reqs", 0) for x in await mgr.client.loads(engine)) < 1:
                assert time.monotonic() < end and not ta.done(), "B never waited while A decoded"
                await asyncio.sleep(0.02)
            # the manager's update: retract-mode pause, flush, load, the version published without aborting, continue
            await mgr.update_weights_from_disk(other, "1")
            a, b = await asyncio.wait_for(asyncio.gather(ta, tb), 600)
    finally:
        await mgr.stop()
    return a["meta_info"], b["meta_info"], done


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_retracted_request_reprefills_with_its_kept_routes(tmp_path):
    from rollout.models.near_tie import build_near_tie_glm

    model, other = build_near_tie_glm(), build_near_tie_glm(path=str(tmp_path / "near-tie-seed1"), seed=1)
    t0 = time.monotonic()
    a, b, done = asyncio.run(_scenario(model, other))
    print(f"scenario {time.monotonic() - t0:.0f} s; A {a.get('routed_experts_retraction_evidence')}")
    assert done == ["B", "A"], f"B must prefill the prompt before A's re-prefill; finished {done}"
    assert a["num_retractions"] == 1 and b["num_retractions"] == 0
    assert a["completion_tokens"] == N and a["weight_version"] == "1"
    word = a["routed_experts_retraction_evidence"]
    assert word["rule"] == "sampling-time" and word["kept_rows"] >= PROMPT, word
    assert word["reprefill_compared"] > 0 and word["reprefill_differ"] == 0, word
