"""The slime adapter end to end: real RolloutManager + Dispatcher attached to a router URL.

The router here is a STAND-IN: a small aiohttp server answering `/generate` like SGLang does
(`meta_info.output_token_logprobs`, `finish_reason`, base64 int32 `routed_experts`), `/workers` and
`/abort_request` like slime's router and its workers. Real SGLang engines are covered by the engine
tests; this checks the slime-facing conversion, streaming, partial rollout and the R3 shape.
"""
import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web

from rollout import slime_adapter
from rollout.routed_experts import MoELayout, encode_sglang
from rollout.slime_types import RolloutFnTrainOutput, Sample

LAYOUT = MoELayout.from_first_k_dense(3, 1, 16, 4)   # the tiny GLM-4.5: 1 dense + 2 MoE layers, top-4 of 16
HANG = 99   # a prompt starting with this token hangs until aborted (a straggler)


def routes(tokens, start_len):
    """Deterministic routes for rows [start_len, len(tokens)-1): layer 0 dense (zeros)."""
    rows = len(tokens) - 1 - start_len
    full = np.zeros((rows, 3, 4), dtype=np.int32)
    for r in range(rows):
        t = tokens[start_len + r]
        for layer in (1, 2):
            full[r, layer] = [(t + layer + k * 3) % 16 for k in range(4)]
    return full


class StandInRouter:
    def __init__(self):
        self.requests = []
        self.aborted = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.ready = threading.Event()

    def _serve(self):
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.aborted = asyncio.Event()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/workers", self.workers)
        app.router.add_post("/abort_request", self.abort)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def workers(self, request):
        return web.json_response({"workers": [{"url": f"http://127.0.0.1:{self.port}", "id": "w0"}]})

    async def abort(self, request):
        self.aborted.set()
        return web.json_response({})

    async def generate(self, request):
        body = await request.json()
        self.requests.append(body)
        ids = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        start_len = body.get("routed_experts_start_len", 0)
        finish = "length"
        if ids[0] == HANG and len(ids) == 2:   # first attempt of the straggler: 1 token, then wait for abort
            n = 1
            await asyncio.wait_for(self.aborted.wait(), 60)
            finish = "abort"
        out = [(ids[-1] + 1 + i) % 300 for i in range(n)]
        meta = {"output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": {"type": finish},
                "weight_version": "7"}
        if body.get("return_routed_experts"):
            meta["routed_experts"] = encode_sglang(routes(ids + out, start_len))
            meta["routed_experts_start_len"] = start_len
        return web.json_response({"text": "", "meta_info": meta})

    def start(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class StandInDataSource:
    """slime's data-source interface (get_samples(n) -> list[list[Sample]]), prompts given as tokens."""

    def __init__(self, prompts, n):
        self.prompts, self.n, self.i = list(prompts), n, 0

    def get_samples(self, k):
        out = []
        for _ in range(k):
            p = self.prompts[self.i]
            self.i += 1
            out.append([Sample(group_index=self.i, index=j, prompt="", tokens=list(p)) for j in range(self.n)])
        return out


async def length_reward(args, sample):
    return float(sample.response_length)


@pytest.fixture
def router():
    r = StandInRouter().start()
    yield r
    slime_adapter.reset()
    r.stop()


def _args(port, **kw):
    base = dict(sglang_router_ip="127.0.0.1", sglang_router_port=port, n_samples_per_prompt=2,
                rollout_batch_size=3, sglang_server_concurrency=8, rollout_num_gpus=1,
                rollout_num_gpus_per_engine=1, use_rollout_routing_replay=True, num_layers=3, num_experts=16,
                moe_router_topk=4, moe_layer_freq=[0, 1, 1], rollout_temperature=1.0, rollout_top_p=1.0,
                rollout_top_k=-1, rollout_max_response_len=4, custom_rm_path=f"{__name__}.length_reward",
                hf_checkpoint=None, partial_rollout=True)
    base.update(kw)
    return SimpleNamespace(**base)


def _check_sample(s, prompt):
    assert s.tokens[:len(prompt)] == prompt
    assert s.response_length == len(s.tokens) - len(prompt) == len(s.rollout_log_probs) == len(s.loss_mask)
    assert s.reward == float(s.response_length)
    re = s.rollout_routed_experts
    assert tuple(re.shape) == (len(s.tokens) - 1, 3, 4) and str(re.dtype) == "torch.int32"
    assert np.array_equal(re.numpy(), routes(s.tokens, 0))   # dense layer zeros, MoE layers as served


def test_generate_rollout_returns_slime_groups(router):
    slime_adapter.reset()
    slime_adapter._STATE["tokenizer"] = None   # prompts arrive as tokens
    args = _args(router.port)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource(prompts, 2))
    assert isinstance(out, RolloutFnTrainOutput)
    assert len(out.samples) == 3 and all(len(g) == 2 for g in out.samples)
    for g in out.samples:
        prompt = [p for p in prompts if g[0].tokens[:len(p)] == p][0]
        for s in g:
            _check_sample(s, prompt)
            assert s.status == Sample.Status.TRUNCATED and s.rollout_id == 0 and s.weight_versions == ["7"]
    assert all(r["return_logprob"] and r["return_routed_experts"] for r in router.requests)
    assert out.metrics["rollout/groups"] == 3


def test_straggler_is_aborted_and_returned_next_step(router):
    slime_adapter.reset()
    slime_adapter._STATE["tokenizer"] = None
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=3)
    src = StandInDataSource([[1, 2], [HANG, 3], [4, 5], [6, 7], [8, 9]], 2)
    first = slime_adapter.generate_rollout(args, 0, src)
    assert len(first.samples) == 2 and first.metrics["rollout/carried"] == 1
    assert all(g[0].tokens[0] != HANG for g in first.samples)
    args.over_sampling_batch_size = 2   # carried straggler + 1 new group: both must be delivered
    second = slime_adapter.generate_rollout(args, 1, src)
    got = {g[0].tokens[0] for g in second.samples}
    assert HANG in got and len(second.samples) == 2 and src.i == 4
    hang = [g for g in second.samples if g[0].tokens[0] == HANG][0]
    for s in hang:   # continued from its partial response: routed experts merged across the two requests
        _check_sample(s, [HANG, 3])
    resumed = [r for r in router.requests if r["input_ids"][0] == HANG and r.get("routed_experts_start_len")]
    assert resumed, "the straggler was not continued with routed_experts_start_len"


def test_custom_generate_function(router):
    slime_adapter.reset()
    slime_adapter._STATE["tokenizer"] = None
    args = _args(router.port)
    s = Sample(prompt="", tokens=[10, 11, 12])

    async def call():
        return await slime_adapter.generate(args, s, {"temperature": 0.0, "max_new_tokens": 3})

    out = asyncio.run(call())
    assert out is s and s.response_length == 3 and s.tokens == [10, 11, 12, 13, 14, 15]
    assert tuple(s.rollout_routed_experts.shape) == (5, 3, 4)
    assert router.requests[-1]["sampling_params"]["temperature"] == 0.0
