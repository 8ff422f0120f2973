"""Plugin mode with `--custom-generate-function-path`: the user's function is called for every training sample,
as slime calls it, and each of its turns (posted to `args.sglang_router_ip/port` + `/generate`, as slime's
examples do) is answered by the manager with group placement: every turn of a group on one worker.

The router and workers are test_slime_adapter's STAND-INs (aiohttp servers answering as SGLang / sglang-router do).
`post` is slime's `slime.utils.http_utils.post` when slime is importable; else a STAND-IN with its contract
(JSON body in, parsed JSON answer out, raise on an HTTP error).
"""
import asyncio
from types import SimpleNamespace

import pytest

from test_slime_adapter import StandInDataSource, StandInRouter, StandInWorker, _args, length_reward  # noqa: F401
from rollout.slime import adapter as slime_adapter
from rollout.slime import Sample

pytestmark = pytest.mark.timeout(60)

try:
    from slime.utils.http_utils import init_http_client, post
except ImportError:
    init_http_client = None

    async def post(url, payload, max_retries=60, headers=None):   # STAND-IN for slime.utils.http_utils.post
        import aiohttp
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=payload, headers=headers) as r:
                r.raise_for_status()
                return await r.json(content_type=None)


def slime_client() -> None:
    """slime's `post` sends with slime's HTTP client, which slime's RolloutManager starts (`init_http_client`)."""
    if init_http_client is not None:
        init_http_client(SimpleNamespace(rollout_num_gpus=1, rollout_num_gpus_per_engine=1,
                                         sglang_server_concurrency=64, use_distributed_post=False))


@pytest.fixture(autouse=True)
def _slime_client():
    slime_client()


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


async def late_two_turns(args, sample, sampling_params):
    """`two_turns` after some work of its own first (a tool set up, a file read): the second sample of a
    group sends its first turn well after the first sample's."""
    await asyncio.sleep(0.1 * (sample.index % 2))
    return await two_turns(args, sample, sampling_params)


def test_a_group_whose_samples_ask_one_by_one_is_primed_once(two_workers):
    """The front's requests of a group come one by one; the group is announced to placement, so its first
    request primes the prompt on the group's rank. Without the word the first request saw no sibling seated and
    sent no primer (then each sibling arriving during the first one's prefill is prefilled again)."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(two_workers.port, custom_generate_function_path=f"{__name__}.late_two_turns",
                 use_rollout_routing_replay=False, rollout_batch_size=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    out = slime_adapter.generate_rollout(args, 1, StandInDataSource(prompts, 2))
    assert len(out.samples) == 2
    assert sorted(tuple(b["input_ids"]) for w in two_workers.ws for b in w.primers) == sorted(map(tuple, prompts))


def _decode_routes(meta, rows):
    import base64
    import numpy as np
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(rows, 3, 4)


TURN_ROUTES = []


async def two_turns_r3(args, sample, sampling_params):
    """Two turns asking for routed experts; returns the sample and a copy (slime's `list[Sample]` fan-out),
    rewarded here (slime then computes no reward)."""
    from test_slime_adapter import routes
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    ids = list(sample.tokens)
    for turn in range(2):
        out = await post(url, {"input_ids": ids, "sampling_params": dict(sampling_params, max_new_tokens=2),
                               "return_logprob": True, "return_routed_experts": True})
        ids += [p[1] for p in out["meta_info"]["output_token_logprobs"]]
        got = _decode_routes(out["meta_info"], len(ids) - 1)   # SGLang's wire: every row of the sequence
        TURN_ROUTES.append(bool((got == routes(ids, 0)).all()) and out["meta_info"]["routed_experts_start_len"] == 0)
        ids += OBSERVATION if turn == 0 else []
    sample.tokens, sample.response_length, sample.reward = ids, len(ids) - len(sample.tokens), 1.0
    sample.status = Sample.Status.COMPLETED
    twin = Sample(group_index=sample.group_index, index=sample.index, tokens=list(ids), reward=0.5,
                  status=Sample.Status.COMPLETED)
    return [sample, twin]


async def batch_reward(args, samples):
    """--custom-rm-path for `list[Sample]` results: slime's batched_async_rm calls it with the list (also empty)."""
    return [float(s.response_length) for s in samples]


def test_every_turn_gets_its_routed_experts_and_fan_out_is_kept(two_workers):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    TURN_ROUTES.clear()
    args = _args(two_workers.port, custom_generate_function_path=f"{__name__}.two_turns_r3", rollout_batch_size=1,
                 custom_rm_path=f"{__name__}.batch_reward")
    out = slime_adapter.generate_rollout(args, 1, StandInDataSource([[1, 2, 3]], 2))
    assert TURN_ROUTES == [True] * 4, TURN_ROUTES   # 2 samples x 2 turns, each with all its rows
    assert len(out.samples) == 1 and [[x.reward for x in s] for s in out.samples[0]] == [[1.0, 0.5]] * 2
    workers = [i for i, w in enumerate(two_workers.ws) if w.requests]
    assert len(workers) == 1 and len(two_workers.ws[workers[0]].requests) == 4


class _Tok:
    """A TOY tokenizer (one token per character) standing in for slime's HF tokenizer."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 90 + 1 for c in text]


TEXTS = []


async def text_turns(args, sample, sampling_params):
    """search-r1's request shape: `text` = prompt + the response so far (SGLang's text + the observation)."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    response = ""
    for turn in range(2):
        out = await post(url, {"text": sample.prompt + response, "sampling_params": sampling_params,
                               "return_logprob": True})
        response += out["text"] + ("<obs>" if turn == 0 else "")
    TEXTS.append(response)
    sample.response, sample.reward, sample.status = response, 0.0, Sample.Status.COMPLETED
    return sample


def test_text_requests_are_tokenized_and_kept_on_their_group_worker(two_workers):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(_Tok())
    TEXTS.clear()
    args = _args(two_workers.port, custom_generate_function_path=f"{__name__}.text_turns", rollout_batch_size=2,
                 use_rollout_routing_replay=False)
    ds = StandInDataSource([[], []], 2)
    ds.get_samples = lambda k, get=ds.get_samples: [[Sample(group_index=g[0].group_index, index=s.index,
                                                            prompt=f"question {g[0].group_index}?") for s in g]
                                                    for g in get(k)]
    out = slime_adapter.generate_rollout(args, 1, ds)
    assert len(TEXTS) == 4 and len(out.samples) == 2
    assert sum(len(w.requests) for w in two_workers.ws) == 8
    for gi in (0, 1):
        ids = _Tok().encode(f"question {gi}?")
        on = {i for i, w in enumerate(two_workers.ws) for r in w.requests if r["input_ids"][:len(ids)] == ids}
        assert len(on) == 1, (gi, on)
    assert out.metrics["rollout/custom_generate_requests"] == 8


def test_front_refuses_what_it_cannot_place_with_one_line():
    """A request the front cannot key to a sample of this step, a text request with no tokenizer, images, and a
    max_new_tokens that is not an int get HTTP 400 with one line (the backend is never asked: None here)."""
    import aiohttp
    from rollout.slime.custom import Front

    async def run():
        front = await Front(backend=None).start()
        front.open_group("g", [1, 2, 3])
        url = f"http://127.0.0.1:{front.port}/generate"
        got = []
        async with aiohttp.ClientSession() as session:
            for body in ({"input_ids": [9, 9]}, {"text": "hi"}, {"input_ids": [1, 2, 3], "image_data": ["x"]},
                         {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": None}}):
                async with session.post(url, json=body) as r:
                    got.append((r.status, await r.text()))
        await front.stop()
        return got

    got = asyncio.run(run())
    assert [s for s, _ in got] == [400] * 4 and all("\n" not in t for _, t in got)
    assert "no prompt of this rollout step" in got[0][1] and "tokenizer" in got[1][1]
    assert "image_data" in got[2][1] and "max_new_tokens" in got[3][1]


# ---- the custom-generate path has the main path's seats, refill, partial rollout and FAILED rule --------------
from test_slime_adapter import HANG, StandInWorker as _Worker  # noqa: E402
from test_slime_plugin_parity import drop_one_two, gate, gated_reward, slime_filter_hub  # noqa: E402,F401

BAD = 98   # a prompt starting with this token gets SGLang's HTTP 400 (a request it refuses: not re-sent)


class RefusingWorker(_Worker):
    """test_slime_adapter's STAND-IN worker; a prompt starting with BAD gets HTTP 400 with SGLang's error body."""

    async def generate_rows(self, request):
        from aiohttp import web
        body = await request.json()
        if body["input_ids"][0] == BAD:
            return web.json_response({"object": "error", "message": "bad input", "type": "BadRequestError",
                                      "param": None, "code": 400}, status=400)
        return await super().generate_rows(request)


async def one_turn(args, sample, sampling_params):
    """slime's own generate in a custom function's clothes: continues the response the sample holds (partial
    rollout), budget max_new_tokens - response_length, status ABORTED on an aborted answer."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sp = dict(sampling_params, max_new_tokens=sampling_params["max_new_tokens"] - sample.response_length)
    out = await post(url, {"input_ids": list(sample.tokens), "sampling_params": sp, "return_logprob": True})
    meta = out["meta_info"]
    new = [p[1] for p in meta["output_token_logprobs"]]
    sample.tokens = list(sample.tokens) + new
    sample.response = (sample.response or "") + out["text"]
    sample.response_length += len(new)
    sample.loss_mask = list(sample.loss_mask or []) + [1] * len(new)
    sample.rollout_log_probs = list(sample.rollout_log_probs or []) + [p[0] for p in meta["output_token_logprobs"]]
    sample.status = {"abort": Sample.Status.ABORTED, "length": Sample.Status.TRUNCATED}.get(
        meta["finish_reason"]["type"], Sample.Status.COMPLETED)
    return sample


@pytest.fixture
def refusing():
    w = RefusingWorker().start()
    r = StandInRouter([(w.url, "regular")]).start()
    r.worker = w
    yield r
    slime_adapter.reset()
    r.stop()
    w.stop()


def test_custom_path_batch_is_exact_and_rewards_wait_for_a_seat(refusing, gate):
    """rollout_batch_size 2, over-sampling 6, a reward that awaits: slime rewards and keeps exactly 2 groups.
    Before, the custom path ran all 6 fetched groups to their rewards at once (12 reward calls, 6 groups inside)."""
    g = gate(12)   # reached only if every group enters its reward: seats not taken first
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(refusing.port, rollout_batch_size=2, over_sampling_batch_size=6, use_rollout_routing_replay=False,
                 custom_generate_function_path=f"{__name__}.one_turn", custom_rm_path="test_slime_plugin_parity.gated_reward")
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[i, i + 1] for i in range(1, 13, 2)], 2))
    assert len(out.samples) == 2 and out.metrics["rollout/groups"] == 2
    assert g.max_groups <= 2, f"{g.max_groups} groups in their reward at once"
    assert g.calls == 4, f"{g.calls} reward calls"


def test_custom_path_failed_turn_raises_one_line_naming_group_engine_and_cause(refusing):
    """A turn SGLang refuses (HTTP 400): slime's step raises; plugin mode raises one line naming the group, the
    engine and the cause, at once (slime's post would retry the front's 500 for a minute). Before, the
    function's own HTTP error (or a FAILED sample handed over) came out instead."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(refusing.port, rollout_batch_size=1, use_rollout_routing_replay=False,
                 custom_generate_function_path=f"{__name__}.one_turn")
    with pytest.raises(RuntimeError) as e:
        slime_adapter.generate_rollout(args, 0, StandInDataSource([[BAD, 1]], 2))
    line = str(e.value)
    assert "\n" not in line and line.startswith("a request of group 0 (custom generate function) failed on engine ")
    assert refusing.worker.url in line and "HTTP 400" in line and "SLIME_MOE_ROLLOUT_DROP_FAILED=1" in line


def test_custom_path_failed_groups_are_dropped_counted_and_refilled(refusing, monkeypatch):
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_DROP_FAILED", "1")
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(refusing.port, rollout_batch_size=2, over_sampling_batch_size=2, use_rollout_routing_replay=False,
                 custom_generate_function_path=f"{__name__}.one_turn")
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[BAD, 1], [1, 2], [3, 4], [5, 6]], 2))
    assert out.metrics["rollout/failed_groups"] == 1
    firsts = sorted(g[0].tokens[0] for g in out.samples)
    # the refill fetched two groups for the one spot left: whichever finishes first takes it
    assert len(firsts) == 2 and firsts[0] == 1 and firsts[1] in (3, 5), firsts
    assert all(s.status != Sample.Status.FAILED for g in out.samples for s in g)


OPEN_AT_FETCH = []


def test_custom_path_refills_while_the_straggler_runs_and_recycles_it_masked(refusing, slime_filter_hub):
    router = refusing
    """Over-sampling with a dynamic filter: the next chunk is fetched while the straggler's turn is open; when the
    batch is full the straggler is aborted and its group goes back through data_source.add_samples (slime's
    partial rollout, start_rollout_id set); next step its function continues it with the off-policy tokens
    masked (--mask-offpolicy-in-partial-rollout). Before, the custom path waited for every group of a round
    (here: the straggler, aborted by no one) and had no partial rollout."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=2, use_rollout_routing_replay=False,
                 custom_generate_function_path=f"{__name__}.one_turn", mask_offpolicy_in_partial_rollout=True,
                 dynamic_sampling_filter_path="test_slime_plugin_parity.drop_one_two")
    src = StandInDataSource([[HANG, 3], [1, 2], [4, 5], [6, 7], [8, 9]], 2)
    got = src.get_samples

    def fetch(k):
        OPEN_AT_FETCH.append(not router.worker.aborted.is_set())
        return got(k)
    src.get_samples = fetch
    OPEN_AT_FETCH.clear()
    first = slime_adapter.generate_rollout(args, 0, src)
    assert OPEN_AT_FETCH == [True, True]   # the refill came while the straggler's turn was open
    assert sorted(g[0].tokens[0] for g in first.samples) == [4, 6]
    assert first.metrics["rollout/recycled_groups"] == 1 and len(src.buffer) == 1
    held = src.buffer[0]
    assert all(s.status == Sample.Status.ABORTED and s.metadata["start_rollout_id"] == 0 and s.response_length == 1
               for s in held)
    second = slime_adapter.generate_rollout(args, 1, src)
    hang = [g for g in second.samples if g[0].tokens[0] == HANG][0]
    assert all(s.loss_mask == [0, 1, 1, 1] and s.response_length == 4 for s in hang), [s.loss_mask for s in hang]
    fresh = [g for g in second.samples if g[0].tokens[0] == 8][0]
    assert all(s.loss_mask == [1, 1, 1, 1] for s in fresh)


def test_custom_path_without_partial_rollout_drops_the_aborted_straggler_as_slime(refusing):
    """Without --partial-rollout slime's abort discards the stragglers' groups; so does plugin mode's custom path
    (nothing carried, nothing pending, nothing added to the data source). Before, the step waited for them."""
    from rollout.slime.state import STATE
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(refusing.port, rollout_batch_size=1, over_sampling_batch_size=2, use_rollout_routing_replay=False,
                 custom_generate_function_path=f"{__name__}.one_turn", partial_rollout=False)
    src = StandInDataSource([[HANG, 3], [1, 2]], 2)
    out = slime_adapter.generate_rollout(args, 0, src)
    assert [g[0].tokens[0] for g in out.samples] == [1] and out.metrics["rollout/recycled_groups"] == 0
    assert src.buffer == [] and STATE.pending == {} and STATE.backend.carried == []
