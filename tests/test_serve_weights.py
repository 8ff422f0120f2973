"""`serve`'s guard for restarted engines, on a REAL keyless SGLang CPU engine (what slime attaches to):
an engine whose weight_version differs from its peers' is paused (no generation) and says so, and is
resumed once its version matches."""
import asyncio
import json
import urllib.request

import pytest
from support.engines import preset

from rollout.cli.serve_weights import WeightGuard
from rollout.manager import RolloutManager, RolloutOptions, engine_source
from rollout.slime.attach import Endpoint

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def _post(url, path, body, timeout):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})   # no key: as slime calls
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def test_restarted_engine_stays_paused_until_its_weights_match(engine_pool, tiny_model):
    eng = engine_pool.get("keyless-a", preset("a", tiny_model, api_key=""))
    said = []

    async def scenario():
        mgr = await RolloutManager(engine_source(endpoints=[Endpoint("e0", eng.url, "")]),
                                   RolloutOptions({"max_new_tokens": 2}, 1, 1)).start()
        guard = WeightGuard(mgr.client, None, said.append, poll_s=0.2)
        tracker = asyncio.create_task(guard.track(mgr))
        await asyncio.sleep(1.0)
        base = mgr.weight_version
        assert base is not None                          # tracked from the live engine's /model_info
        tracker.cancel()
        mgr.set_weight_version("v7")                     # its peers were updated by slime meanwhile
        hook = asyncio.create_task(guard.hook(Endpoint("e0", eng.url, ""), "v7"))
        await asyncio.sleep(2.0)
        assert not hook.done() and "PAUSED" in said[0] and "'v7'" in said[0]
        gen = asyncio.create_task(asyncio.to_thread(
            _post, eng.url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}, 120))
        await asyncio.sleep(3.0)
        paused_answer = gen.done() and gen.result()
        await asyncio.to_thread(_post, eng.url, "/update_weight_version", {"new_version": "v7"}, 60)
        await asyncio.wait_for(hook, 30)
        assert "resumed" in said[-1]
        out = await asyncio.wait_for(gen, 120) if not gen.done() else gen.result()
        await mgr.stop()
        return base, paused_answer, out

    base, paused_answer, out = asyncio.run(scenario())
    finish = (paused_answer or {}).get("meta_info", {}).get("finish_reason", {}) if paused_answer else None
    assert not paused_answer or finish.get("type") == "abort", f"generated while paused: {paused_answer}"
    assert base != "v7" and out is not None
