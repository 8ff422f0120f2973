"""Plugin mode with `--custom-generate-function-path`: the user's function is called for every training sample,
as slime calls it, and each of its turns (posted to `args.sglang_router_ip/port` + `/generate`, as slime's
examples do) is answered by the manager with group placement: every turn of a group on one worker.

The router and workers are test_slime_adapter's STAND-INs (aiohttp servers answering as SGLang / sglang-router do).
`post` is slime's `slime.utils.http_utils.post` when slime is importable; else a STAND-IN with its contract
(JSON body in, parsed JSON answer out, raise on an HTTP error).
"""
import asyncio

import pytest

from test_slime_adapter import StandInDataSource, StandInRouter, StandInWorker, _args, length_reward  # noqa: F401
from rollout.slime import adapter as slime_adapter
from rollout.slime import Sample

pytestmark = pytest.mark.timeout(60)

try:
    from slime.utils.http_utils import post
except ImportError:
    async def post(url, payload, max_retries=60, headers=None):   # STAND-IN for slime.utils.http_utils.post
        import aiohttp
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=payload, headers=headers) as r:
                r.raise_for_status()
                return await r.json(content_type=None)

OBSERVATION = [77, 78]   # the tool's answer, appended between the turns
CALLS = []


async def two_turns(args, sample, sampling_params):
    """A generate function in slime's style (examples/search-r1): turn, tool observation (loss mask 0), turn."""
    CALLS.append(sample.index)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = list(sample.tokens)
    ids, mask, logps = list(prompt), [], []
    for turn in range(2):
        sp = dict(sampling_params, max_new_tokens=2)
        out = await post(url, {"input_ids": ids, "sampling_params": sp, "return_logprob": True})
        new = [p[1] for p in out["meta_info"]["output_token_logprobs"]]
        ids += new
        mask += [1] * len(new)
        logps += [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        if turn == 0:
            ids += OBSERVATION
            mask += [0] * len(OBSERVATION)
            logps += [0.0] * len(OBSERVATION)
    sample.tokens = ids
    sample.response_length = len(ids) - len(prompt)
    sample.loss_mask, sample.rollout_log_probs = mask, logps
    sample.status = Sample.Status.COMPLETED
    return sample


@pytest.fixture
def two_workers():
    ws = [StandInWorker().start(), StandInWorker().start()]
    r = StandInRouter([(w.url, "regular") for w in ws]).start()
    r.ws = ws
    yield r
    slime_adapter.reset()
    r.stop()
    for w in ws:
        w.stop()


def test_custom_generate_function_runs_for_every_sample_and_turn_on_one_worker(two_workers):
    """Fails on the adapter without the custom branch: the function is called 0 times in training."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    CALLS.clear()
    args = _args(two_workers.port, custom_generate_function_path=f"{__name__}.two_turns",
                 use_rollout_routing_replay=False, rollout_batch_size=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    out = slime_adapter.generate_rollout(args, 1, StandInDataSource(prompts, 2))
    assert sorted(CALLS) == [0, 1, 2, 3], f"custom generate calls: {CALLS}"
    assert len(out.samples) == 2 and all(len(g) == 2 for g in out.samples)
    assert args.sglang_router_port == two_workers.port   # slime's router address is back after the step
    for g in out.samples:
        for s in g:
            assert s.loss_mask == [1, 1, 0, 0, 1, 1] and s.reward == float(s.response_length) == 6.0
    # every turn of every sample reached a worker directly, never the router; a group's turns on one worker
    assert two_workers.requests == []
    seen = {}
    for i, w in enumerate(two_workers.ws):
        for r in w.requests:
            prompt = next(tuple(p) for p in prompts if r["input_ids"][:len(p)] == p)
            seen.setdefault(prompt, set()).add(i)
    assert sum(len(w.requests) for w in two_workers.ws) == 8   # 2 groups x 2 samples x 2 turns
    assert all(len(v) == 1 for v in seen.values()), seen
    assert out.metrics["rollout/custom_generate_requests"] == 8
