"""`rollout.slime.generate_rollout_fully_async` on a REAL SGLang CPU engine through three weight updates done
with slime's own sequence on the engine (`pause_generation` with slime's empty body, `flush_cache`,
`update_weights_from_disk` with a `weight_version`, `continue_generation`), the pool running during each
update. slime's router is the stand-in of tests/test_slime_adapter.py (discovery only: `GET /workers`).

It shows what the real engine says and what the function does with it: every group delivered once, every
response token's version taken from SGLang's own `meta_info`, and no group past `max_weight_version_lag`
delivered."""
import json
import time
import urllib.request
from types import SimpleNamespace

import pytest
from support.engines import preset
from test_slime_adapter import StandInDataSource, StandInRouter, length_reward  # noqa: F401

from rollout.slime import fully_async
from rollout.slime.fully_async import SPANS, generate_rollout_fully_async

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]


def _post(url, path, body, timeout=120):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})   # keyless: as slime calls
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def _slime_update(url, model_path, version):
    """slime's update sequence on one engine (sglang_engine.py: pause with `{}`, flush, update, continue)."""
    _post(url, "/pause_generation", {})
    _post(url, "/flush_cache", {})
    _post(url, "/update_weights_from_disk", {"model_path": model_path, "weight_version": version})
    _post(url, "/continue_generation", {})


def test_pool_across_slimes_weight_updates_on_a_real_engine(engine_pool, tiny_model):
    eng = engine_pool.get("keyless-a", preset("a", tiny_model, api_key=""))
    router = StandInRouter([(eng.url, "regular")]).start()
    _slime_update(eng.url, tiny_model, "1")
    prompts = [[3 + i, 7 + i, 11 + i] for i in range(16)]
    args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=router.port, n_samples_per_prompt=2,
                           rollout_batch_size=2, sglang_server_concurrency=4, rollout_num_gpus=1,
                           rollout_num_gpus_per_engine=1, use_rollout_routing_replay=False,
                           rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
                           rollout_max_response_len=24, custom_rm_path=f"{__name__}.length_reward",
                           hf_checkpoint=None, partial_rollout=False, max_weight_version_lag=1)
    src = StandInDataSource(prompts, 2)
    outs, served = [], []
    try:
        fully_async.reset()
        fully_async.STATE.tokenizer = None
        for step in range(4):
            served.append(str(step + 1))
            outs.append(generate_rollout_fully_async(args, step, src))
            time.sleep(0.5)   # the trainer trains; the pool keeps generating, then slime updates the weights
            if step < 3:
                _slime_update(eng.url, tiny_model, str(step + 2))
    finally:
        fully_async.reset()
        router.stop()
    delivered = [g[0].index for out in outs for g in out.samples]
    assert all(len(out.samples) == 2 for out in outs), [out.metrics for out in outs]
    assert len(delivered) == len(set(delivered)) == 8
    for out, v in zip(outs, served):
        for g in out.samples:
            for s in g:
                spans = s.metadata[SPANS]
                assert spans[0]["start"] == 0 and spans[-1]["end"] == s.response_length > 0
                assert min(int(x["version"]) for x in spans) >= int(v) - 1, (v, spans)   # the bound held
                assert s.weight_versions and s.reward == float(s.response_length)
    print("fully-async on a real engine:", [{k: out.metrics[k] for k in (
        "rollout/stale_groups", "rollout/in_flight_groups", "rollout/ready_groups", "rollout/weight_version")}
        for out in outs])
