"""The slime adapter end to end: real RolloutManager + Dispatcher attached to the workers behind slime's router.

The router and its workers here are STAND-INs: small aiohttp servers; the worker answers `/generate` like
SGLang does (`meta_info.output_token_logprobs`, `finish_reason`, base64 int32 `routed_experts`) and
`/abort_request`; the router answers `/workers` as sglang-router 0.3.2 was recorded answering. Real
SGLang engines are covered by the engine tests; this checks the slime-facing conversion, streaming, partial rollout and the R3 shape.
"""
import asyncio
import json
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web
from support.fake_sglang import FakeSGLang, Loopback, answer
from support import slime_standin

from rollout.slime import adapter as slime_adapter
from rollout.routed_experts import MoELayout, encode_sglang
from rollout.slime import RolloutFnTrainOutput, Sample

LAYOUT = MoELayout.from_first_k_dense(3, 1, 16, 4)   # the tiny GLM-4.5: 1 dense + 2 MoE layers, top-4 of 16
HANG = 99   # a prompt starting with this token hangs until aborted (a straggler)
FACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "facts")
with open(os.path.join(FACTS, "sglang-router-0.3.2-workers.json")) as fh:
    ROUTER_FACT = json.load(fh)


def routes(tokens, start_len):
    """Deterministic routes for rows [start_len, len(tokens)-1): layer 0 dense (zeros)."""
    rows = len(tokens) - 1 - start_len
    full = np.zeros((rows, 3, 4), dtype=np.int32)
    for r in range(rows):
        t = tokens[start_len + r]
        for layer in (1, 2):
            full[r, layer] = [(t + layer + k * 3) % 16 for k in range(4)]
    return full


def text_of(ids):
    """The stand-in's detokenized text (SGLang answers with its own text; slime keeps it verbatim)."""
    return "".join(f"<{t}>" for t in ids)


def encode_int32(values):
    import base64
    return base64.b64encode(np.asarray(values, dtype=np.int32).tobytes()).decode()


class StandInWorker(FakeSGLang):
    """An SGLang worker behind slime's router (the fake SGLang server): /generate by the rule of `routes`,
    /abort_request ends the straggler."""

    def __init__(self):
        super().__init__({"/generate": self.generate_rows, "/abort_request": self.abort})
        self.requests, self.primers = [], []
        self.aborted = None

    def start(self):
        super().start()
        self.aborted = asyncio.run_coroutine_threadsafe(_event(), self.loop).result(10)
        return self

    async def abort(self, request):
        self.aborted.set()
        return web.json_response({})

    async def generate_rows(self, request):
        body = await request.json()
        # group placement's primer (the prompt, zero new tokens) is kept apart from slime's own requests
        (self.primers if body["sampling_params"].get("max_new_tokens") == 0 else self.requests).append(body)
        ids = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        start_len = body.get("routed_experts_start_len", 0)
        finish = "length"
        # first attempt of the straggler: 1 token, then wait for abort (a zero-token request is only a prefill,
        # answered at once as SGLang 0.5.23 does: tests/facts/sglang-0.5.23-prefix-cache.json)
        if ids[0] == HANG and len(ids) == 2 and n > 0:
            n = 1
            await asyncio.wait_for(self.aborted.wait(), 60)
            finish = "abort"
        out = [(ids[-1] + 1 + i) % 300 for i in range(n)]
        routed = encode_sglang(routes(ids + out, start_len)) if body.get("return_routed_experts") else None
        meta = answer(out, {"type": finish}, logprob=-0.5, weight_version="7", prompt_tokens=len(ids),
                      routed_experts=routed)["meta_info"]
        if routed is not None:
            meta["routed_experts_start_len"] = start_len
        if body["sampling_params"].get("custom_params", {}).get("return_top_p_token_ids"):
            meta["top_p_token_ids"] = encode_int32(out)                 # one kept id per token
            meta["top_p_token_offsets"] = encode_int32(list(range(len(out) + 1)))
        return web.json_response({"text": text_of(out), "meta_info": meta})


async def _event():
    return asyncio.Event()


class StandInRouter(Loopback):
    """slime's router as plugin mode uses it: `GET /workers` only, answered in the shape sglang-router 0.3.2
    was recorded answering (tests/facts/sglang-router-0.3.2-workers.json); each entry is the recorded one
    with the worker's URL and type. Its /generate is the real router's: it drops return_routed_experts
    (recorded too), so a request sent here comes back without routed experts."""

    def __init__(self, workers=()):
        super().__init__({"/workers": self.list_workers, "/generate": self.generate})
        self.workers = list(workers)   # [(url, worker_type)]: edit to register / remove workers
        self.requests, self.primers = [], []

    async def list_workers(self, request):
        entries = [dict(ROUTER_FACT["workers_listing"]["workers"][0], url=u, worker_type=t, id=f"w{i}")
                   for i, (u, t) in enumerate(self.workers)]
        return web.json_response(dict(ROUTER_FACT["workers_listing"], workers=entries, total=len(entries)))

    async def generate(self, request):
        """Forward to the first regular worker without return_routed_experts (as recorded); with none
        (prefill/decode stand-ins here), answer one token without routed experts."""
        import aiohttp
        body = await request.json()
        # group placement's primer (the prompt, zero new tokens) is kept apart from slime's own requests
        (self.primers if body["sampling_params"].get("max_new_tokens") == 0 else self.requests).append(body)
        regular = [u for u, t in self.workers if t == "regular"]
        if regular:
            fwd = {k: v for k, v in body.items() if k != "return_routed_experts"}
            async with aiohttp.ClientSession() as session:
                async with session.post(regular[0] + "/generate", json=fwd) as r:
                    return web.json_response(await r.json())
        return web.json_response({"text": "", "meta_info": answer([1], {"type": "length"}, logprob=-0.5)["meta_info"]})


class StandInDataSource:
    """slime's data-source interface (get_samples(n) -> list[list[Sample]]), prompts given as tokens;
    numbered as slime's RolloutDataSource does: group_index per group, index unique per sample."""

    def __init__(self, prompts, n):
        self.prompts, self.n, self.i, self.k = list(prompts), n, 0, 0
        self.buffer = []   # slime's RolloutDataSourceWithBuffer: add_samples appends, get_samples pops first

    def add_samples(self, groups):
        assert isinstance(groups, list) and all(isinstance(g, list) and len(g) == self.n for g in groups)
        self.buffer += groups

    def get_samples(self, k):
        out, self.buffer = self.buffer[:k], self.buffer[k:]
        k -= len(out)
        for _ in range(min(k, len(self.prompts) - self.i)):
            p = self.prompts[self.i]
            out.append([Sample(group_index=self.i, index=self.k + j, prompt="", tokens=list(p))
                        for j in range(self.n)])
            self.i += 1
            self.k += self.n
        return out


async def length_reward(args, sample):
    return float(sample.response_length)


@pytest.fixture
def router():
    """slime's router with one worker registered; `router.worker` is where requests must go."""
    w = StandInWorker().start()
    r = StandInRouter([(w.url, "regular")]).start()
    r.worker = w
    yield r
    slime_adapter.reset()
    r.stop()
    w.stop()


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


# The request body slime's own rollout sends for args like `_args` (slime's GenerateState, 624b824):
SLIME_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4, "stop": None,
                  "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                  "spaces_between_special_tokens": False}


def test_generate_rollout_returns_slime_groups(router):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)   # prompts arrive as tokens
    args = _args(router.port)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    out = slime_adapter.generate_rollout(args, 5, StandInDataSource(prompts, 2))
    assert isinstance(out, RolloutFnTrainOutput)
    assert len(out.samples) == 3 and all(len(g) == 2 for g in out.samples)
    assert [g[0].index for g in out.samples] == [0, 2, 4]     # slime sorts groups by index
    for g in out.samples:
        prompt = [p for p in prompts if g[0].tokens[:len(p)] == p][0]
        for s in g:
            _check_sample(s, prompt)
            assert s.status == Sample.Status.TRUNCATED and s.weight_versions == ["7"]
            assert s.rollout_id is None          # slime: one id per rollout execution, not the step id
            assert s.response == text_of(s.tokens[len(prompt):])   # SGLang's text, verbatim
    for r in router.worker.requests:
        assert r["sampling_params"] == SLIME_SAMPLING and r["return_logprob"] is True
        assert r["return_routed_experts"] is True
    assert out.metrics["rollout/groups"] == out.metrics["rollout/groups_on_one_rank"] == 3
    assert router.requests == []   # the router only said who its workers are


def _worker_rollout(router, step, prompts):
    slime_adapter.set_tokenizer(None)
    return slime_adapter.generate_rollout(_args(router.port, rollout_batch_size=len(prompts)), step,
                                          StandInDataSource(prompts, 2))


def test_workers_are_relisted_every_step():
    """slime adds, restarts and removes engines through its router (`POST/DELETE /workers`): each step
    sends only to the workers the router lists then."""
    w1, w2, w3 = (StandInWorker().start() for _ in range(3))
    router = StandInRouter([(w1.url, "regular"), (w2.url, "regular")]).start()
    try:
        slime_adapter.reset()
        first = _worker_rollout(router, 0, [[1, 2], [3, 4], [5, 6], [7, 8]])
        assert w1.requests and w2.requests and not w3.requests
        router.workers = [(w2.url, "regular"), (w3.url, "regular")]   # w1 removed, w3 registered
        n1 = len(w1.requests)
        second = _worker_rollout(router, 1, [[9, 10], [11, 12], [13, 14], [15, 16]])
        assert len(w1.requests) == n1 and w3.requests
        for out in (first, second):
            for g in out.samples:
                for s in g:
                    _check_sample(s, s.tokens[:2])
        assert router.requests == []
    finally:
        slime_adapter.reset()
        for srv in (router, w1, w2, w3):
            srv.stop()


def test_each_group_runs_on_one_worker_and_the_step_says_so():
    """Plugin mode has group placement (the manager's default): both samples of a group go to one worker,
    after its prompt's primer there; `rollout/groups_on_one_rank` counts such groups (slime logs it)."""
    w1, w2 = StandInWorker().start(), StandInWorker().start()
    router = StandInRouter([(w1.url, "regular"), (w2.url, "regular")]).start()
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    try:
        slime_adapter.reset()
        out = _worker_rollout(router, 0, prompts)
        where = {tuple(p): {i for i, w in enumerate((w1, w2)) for r in w.requests if r["input_ids"] == p}
                 for p in prompts}   # prompt -> the workers its samples went to
        assert all(len(ws) == 1 for ws in where.values()) and w1.requests and w2.requests, where
        assert sorted(tuple(b["input_ids"]) for w in (w1, w2) for b in w.primers) == sorted(map(tuple, prompts))
        assert out.metrics["rollout/groups_on_one_rank"] == len(prompts)
    finally:
        slime_adapter.reset()
        for srv in (router, w1, w2):
            srv.stop()


def test_router_without_workers_fails_the_step_with_one_line(monkeypatch):
    """The recorded router answers `POST /workers` with 202 (queued): the list is re-read for a while
    (here 0.5 s) before the step fails."""
    from rollout.manager import EnginesLost
    from rollout.slime import attach
    assert ROUTER_FACT["register"] == "POST /workers 202"
    monkeypatch.setattr(attach, "EMPTY_WAIT_S", 0.5)
    router = StandInRouter([]).start()
    try:
        slime_adapter.reset()
        with pytest.raises(EnginesLost, match=r"slime's router http://127.0.0.1:\d+ lists no workers"):
            _worker_rollout(router, 0, [[1, 2]])
    finally:
        slime_adapter.reset()
        router.stop()


def test_a_worker_registered_while_attaching_is_waited_for():
    """slime registers each engine with POST /workers (202, added in the background) just before the
    first rollout: an empty list at attach time is re-read, not a failure."""
    w = StandInWorker().start()
    router = StandInRouter([]).start()
    timer = threading.Timer(1.0, lambda: router.workers.append((w.url, "regular")))
    timer.start()
    try:
        slime_adapter.reset()
        out = _worker_rollout(router, 0, [[1, 2]])
        assert w.requests and all(s.rollout_routed_experts is not None for s in out.samples[0])
    finally:
        timer.cancel()
        slime_adapter.reset()
        router.stop()
        w.stop()


def test_prefill_decode_workers_are_reached_through_the_router():
    """PD disaggregation: only slime's router pairs prefill and decode workers, so it stays the one slot
    (and R3 then depends on the router build: the recorded 0.3.2 router drops return_routed_experts)."""
    assert ROUTER_FACT["forwards_return_routed_experts"] is False
    router = StandInRouter([("http://127.0.0.1:1", "prefill"), ("http://127.0.0.1:2", "decode")]).start()
    try:
        slime_adapter.reset()
        with pytest.raises(RuntimeError) as e:   # no routed experts came back: slime raises, so does plugin mode
            _worker_rollout(router, 0, [[1, 2]])
        assert len(router.requests) == 2
        assert "sample index 0 (group 0) failed on engine" in str(e.value) and "routed" in str(e.value)
    finally:
        slime_adapter.reset()
        router.stop()


def test_top_p_and_seeds_are_requested_as_slime_does(router):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_top_p=0.9, sglang_enable_deterministic_inference=True, rollout_seed=42,
                 rollout_batch_size=1, rollout_stop=["</s>"], rollout_stop_token_ids=[2])
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2]], 2))
    seeds = sorted(r["sampling_params"]["sampling_seed"] for r in router.worker.requests)
    assert seeds == [42, 43]                        # rollout_seed + index in the group
    sp = router.worker.requests[0]["sampling_params"]
    assert sp["custom_params"] == {"return_top_p_token_ids": True} and sp["top_p"] == 0.9
    assert sp["stop"] == ["</s>"] and sp["stop_token_ids"] == [2]
    for s in out.samples[0]:
        assert list(s.rollout_top_p_token_offsets) == list(range(s.response_length + 1))
        assert list(s.rollout_top_p_token_ids) == s.tokens[2:]


async def group_reward(args, samples):
    """A --group-rm reward: slime calls it once per group, with the list of samples."""
    assert isinstance(samples, list)
    return [float(len(samples))] * len(samples)


def test_group_rm_rewards_the_whole_group(router):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, group_rm=True, custom_rm_path=f"{__name__}.group_reward", rollout_batch_size=1)
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2]], 2))
    assert [s.reward for s in out.samples[0]] == [2.0, 2.0]


def test_straggler_is_aborted_and_returned_next_step(router):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=3)
    src = StandInDataSource([[1, 2], [HANG, 3], [4, 5], [6, 7], [8, 9]], 2)
    first = slime_adapter.generate_rollout(args, 0, src)
    assert len(first.samples) == 2 and first.metrics["rollout/carried"] == 1
    assert all(g[0].tokens[0] != HANG for g in first.samples)
    # slime's partial rollout: the straggler went back through data_source.add_samples, its tokens so far kept
    assert first.metrics["rollout/recycled_groups"] == 1 and len(src.buffer) == 1
    assert all(s.metadata["start_rollout_id"] == 0 and s.response_length == 1 for s in src.buffer[0])
    args.over_sampling_batch_size = 2   # one fetch of 2: the buffered straggler first, then one new prompt
    second = slime_adapter.generate_rollout(args, 1, src)
    got = {g[0].tokens[0] for g in second.samples}
    assert HANG in got and len(second.samples) == 2 and src.i == 4 and src.buffer == []
    hang = [g for g in second.samples if g[0].tokens[0] == HANG][0]
    for s in hang:   # continued from its partial response: routed experts merged across the two requests
        _check_sample(s, [HANG, 3])
    resumed = [r for r in router.worker.requests if r["input_ids"][0] == HANG and r.get("routed_experts_start_len")]
    assert resumed, "the straggler was not continued with routed_experts_start_len"


def test_custom_generate_function(router):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port)
    s = Sample(prompt="", tokens=[10, 11, 12])

    async def call():
        return await slime_adapter.generate(args, s, {"temperature": 0.0, "max_new_tokens": 3})

    out = asyncio.run(call())
    assert out is s and s.response_length == 3 and s.tokens == [10, 11, 12, 13, 14, 15]
    assert tuple(s.rollout_routed_experts.shape) == (5, 3, 4)
    assert router.worker.requests[-1]["sampling_params"]["temperature"] == 0.0


def test_custom_generate_budget_is_the_total_response_length(router):
    """slime: max_new_tokens is the whole response budget; a continuation asks for the rest, and a
    sample with nothing left is TRUNCATED without a request (never 'at least one token')."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port)
    s = Sample(prompt="", tokens=[10, 11, 12, 20, 21], response_length=2, loss_mask=[1, 1],
               rollout_log_probs=[-0.1, -0.2], rollout_routed_experts=routes([10, 11, 12, 20, 21], 0))
    s.status = Sample.Status.ABORTED
    asyncio.run(slime_adapter.generate(args, s, {"max_new_tokens": 3}))
    assert router.worker.requests[-1]["sampling_params"]["max_new_tokens"] == 1
    assert s.response_length == 3 and s.rollout_log_probs == [-0.1, -0.2, -0.5]
    # the rows slime held are continued, not asked for again, and merged by the same entry point
    assert router.worker.requests[-1]["routed_experts_start_len"] == 4
    assert np.array_equal(s.rollout_routed_experts.numpy(), routes(s.tokens, 0))
    sent = len(router.worker.requests)
    asyncio.run(slime_adapter.generate(args, s, {"max_new_tokens": 3}))
    assert len(router.worker.requests) == sent and s.status == Sample.Status.TRUNCATED and s.response_length == 3


def test_custom_generate_refuses_held_rows_that_are_not_routing(router):
    """The rows slime holds go through the same checks as an answer's before they are continued."""
    from rollout.routed_experts import RoutedExpertsError
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    held = routes([10, 11, 12, 20, 21], 0)
    held[1, 0] = [1, 2, 3, 4]   # ids in the dense layer 0
    s = Sample(prompt="", tokens=[10, 11, 12, 20, 21], response_length=2, loss_mask=[1, 1],
               rollout_log_probs=[-0.1, -0.2], rollout_routed_experts=held)
    with pytest.raises(RoutedExpertsError, match="dense layer 0 carries expert ids"):
        asyncio.run(slime_adapter.generate(_args(router.port), s, {"max_new_tokens": 3}))
    assert router.worker.requests == []


def test_evaluation_runs_slimes_eval_or_says_why_not():
    if slime_standin.REAL:
        pytest.skip("slime importable: the eval path runs in tests/test_slime_real.py")
    with pytest.raises(RuntimeError, match=r"evaluation=True .* needs slime importable"):
        slime_adapter.generate_rollout(SimpleNamespace(), 0, None, evaluation=True)
