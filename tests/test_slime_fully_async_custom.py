"""slime's fully-async rollout (`rollout.slime.generate_rollout_fully_async`) with `--custom-generate-function-path`:
each group of the pool runs the user's function per sample, as plugin mode does, between and across slime's calls.

The router and the workers are STAND-INs (tests/test_slime_adapter.py's router, tests/test_slime_fully_async.py's
versioned worker answering SGLang 0.5.23's weight versions, tests/test_slime_custom_generate.py's refusing and
aborting worker);
`post` is slime's where slime is importable, else test_slime_custom_generate's STAND-IN with its contract.
"""
import asyncio
import json
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
from support import slime_standin  # noqa: F401 - slime's types under slime's names where slime is missing
from test_slime_adapter import HANG, StandInDataSource, StandInRouter, length_reward  # noqa: F401
from test_slime_custom_generate import BAD, OBSERVATION, RefusingWorker, one_turn, post, slime_client  # noqa: F401
from test_slime_fully_async import HOLD, VersionedWorker, _args

from rollout.slime import Sample, fully_async
from rollout.slime.fully_async import SPANS, generate_rollout_fully_async

pytestmark = pytest.mark.timeout(120)
PAUSE = 97                 # a prompt starting with this: the function waits between its turns until RESUME
RESUME = threading.Event()
WAITING = []               # samples of PAUSE groups whose function waits between its turns


async def two_turns(args, sample, sampling_params):
    """A multi-turn function in slime's style: turn, a tool's observation (loss mask 0), turn. It fills no
    weight versions of its own."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = list(sample.tokens)
    ids, mask = list(prompt), []
    for turn in range(2):
        out = await post(url, {"input_ids": ids, "sampling_params": dict(sampling_params, max_new_tokens=2),
                               "return_logprob": True})
        new = [p[1] for p in out["meta_info"]["output_token_logprobs"]]
        ids, mask = ids + new, mask + [1] * len(new)
        if turn == 0:
            ids, mask = ids + OBSERVATION, mask + [0] * len(OBSERVATION)
            if prompt[0] == PAUSE:
                WAITING.append(sample.index)
                for _ in range(6000):   # up to 60 s: the test sets RESUME after a weight update
                    if RESUME.is_set():
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise TimeoutError("RESUME never set")
    sample.tokens, sample.response_length, sample.loss_mask = ids, len(ids) - len(prompt), mask
    sample.status = Sample.Status.COMPLETED
    return sample


def _wait(cond, what, s=30.0):
    for _ in range(int(s / 0.01)):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class Workers(SimpleNamespace):
    def update(self):
        for w in self.ws:
            w.update()

    def requests_of(self, first):
        return [(i, b) for i, w in enumerate(self.ws) for b in w.requests_of(first)]


def _workers(n):
    ws = [VersionedWorker().start() for _ in range(n)]
    r = StandInRouter([(w.url, "regular") for w in ws]).start()
    yield Workers(ws=ws, router=r)
    RESUME.set()
    for w in ws:
        w.release()
    fully_async.reset()
    r.stop()
    for w in ws:
        w.stop()


@pytest.fixture
def two():
    yield from _workers(2)


@pytest.fixture
def one():   # with concurrency 4, two groups in flight (as in tests/test_slime_fully_async.py)
    yield from _workers(1)


def _start(port, prompts, **kw):
    fully_async.reset()
    fully_async.STATE.tokenizer = None   # prompts arrive as tokens
    RESUME.clear()
    WAITING.clear()
    return _fa_args(port, **dict({"custom_generate_function_path": f"{__name__}.two_turns"}, **kw)), \
        StandInDataSource(prompts, 2)


def _fa_args(port, **kw):
    slime_client()
    return _args(port, **kw)


NORMAL = [[2 * i + 1, 2 * i + 2] for i in range(1, 6)]


def test_custom_function_in_the_pool_every_group_once_and_spans_across_an_update(two):
    """The PAUSE group's turns are sampled by versions 1 and 2 (the update falls between them): each of its samples
    says which tokens which version sampled, and weight_versions names each answer's. Every group is delivered
    once across three calls, each seated on one worker; slime's own args keep the router address
    while the functions run in the background. Before: the call raised at once ("runs groups through the
    manager only: --custom-generate-function-path is not supported here")."""
    args, src = _start(two.router.port, [[PAUSE, 1]] + NORMAL, sglang_server_concurrency=8)
    outs = [generate_rollout_fully_async(args, 0, src)]
    _wait(lambda: len(WAITING) == 2, "the PAUSE group's functions between their turns")
    assert args.sglang_router_port == two.router.port   # functions in flight: slime's eval would reach the router
    two.update()
    RESUME.set()
    outs += [generate_rollout_fully_async(args, step, src) for step in (1, 2)]
    delivered = [g[0].index for out in outs for g in out.samples]
    assert all(len(out.samples) == 2 for out in outs) and len(delivered) == len(set(delivered)) == 6
    paused = [g for out in outs for g in out.samples if g[0].tokens[0] == PAUSE]
    assert len(paused) == 1
    for s in paused[0]:
        assert s.metadata[SPANS] == [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 4, "end": 6}]
        assert s.weight_versions == ["1", "2"]
        assert s.loss_mask == [1, 1, 0, 0, 1, 1] and s.reward == 6.0
    for out in outs:
        for g in out.samples:
            for s in g:
                assert s.metadata[SPANS][-1]["end"] == s.response_length == 6 and s.status.name == "COMPLETED"
        assert out.metrics["rollout/stale_groups"] == 0
    assert sum(out.metrics["rollout/custom_generate_requests"] for out in outs) == 6 * 2 * 2
    together = 0
    for first in [PAUSE] + [p[0] for p in NORMAL]:
        turns = two.requests_of(first)
        assert len({i for i, b in turns if len(b["input_ids"]) == 2}) == 1, turns   # a fresh group is seated together
        together += len({i for i, _ in turns}) == 1   # later turns go back there (unless re-balanced: manager.md)
    assert sum(out.metrics["rollout/groups_on_one_rank"] for out in outs) == together
    assert fully_async._POOL.sink.groups == []   # delivered groups are not kept by the pool's sink


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_custom_group_older_than_the_lag_is_regenerated_or_dropped_and_counted(one, policy):
    """The HOLD group's first turns are held from version 1 until version 3 (spans of 1 and 3), its second turn
    is sampled by 3: past max_weight_version_lag 1, it is never delivered; regenerate runs the function again
    from the prompt (all tokens of version 3), drop leaves its prompt out. Counted either way."""
    args, src = _start(one.router.port, [[HOLD, 1]] + NORMAL[:5], max_weight_version_lag=1, stale_groups=policy)
    outs, served = [], []
    for step in range(3):
        served.append(one.ws[0].version)
        outs.append(generate_rollout_fully_async(args, step, src))
        one.update()
        if step == 1:
            one.ws[0].release()
    for out, v in zip(outs, served):
        for g in out.samples:
            assert min(int(sp["version"]) for s in g for sp in s.metadata[SPANS]) >= int(v) - 1
    held = [g for out in outs for g in out.samples if g[0].tokens[0] == HOLD]
    m = {k: sum(out.metrics[k] for out in outs) for k in ("rollout/stale_groups", "rollout/stale_regenerated",
                                                             "rollout/stale_dropped", "rollout/stale_tokens")}
    assert m["rollout/stale_groups"] == 1 and m["rollout/stale_tokens"] == 2 * 6
    if policy == "regenerate":
        assert m["rollout/stale_regenerated"] == 1 and len(held) == 1
        assert {sp["version"] for s in held[0] for sp in s.metadata[SPANS]} == {"3"}
        assert len(one.requests_of(HOLD)) == 2 * 2 * 2   # both samples' two turns, twice
    else:
        assert m["rollout/stale_dropped"] == 1 and held == []
    delivered = [g[0].index for out in outs for g in out.samples]
    assert len(delivered) == len(set(delivered)) == (6 if policy == "regenerate" else 5)


@pytest.fixture
def refusing():
    w = RefusingWorker().start()
    r = StandInRouter([(w.url, "regular")]).start()
    r.worker = w
    yield r
    fully_async.reset()
    r.stop()
    w.stop()


def test_custom_failed_turn_raises_plugin_modes_one_line(refusing):
    fully_async.reset()
    fully_async.STATE.tokenizer = None
    args = _fa_args(refusing.port, custom_generate_function_path=f"{__name__}.one_turn", rollout_batch_size=1)
    with pytest.raises(RuntimeError) as e:
        generate_rollout_fully_async(args, 0, StandInDataSource([[BAD, 1]], 2))
    line = str(e.value)
    assert "\n" not in line and line.startswith("a request of group 0 (custom generate function) failed on engine ")
    assert refusing.worker.url in line and "HTTP 400" in line and "SLIME_MOE_ROLLOUT_DROP_FAILED=1" in line


def test_custom_failed_group_dropped_counted_and_the_rest_delivered(refusing, monkeypatch):
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_DROP_FAILED", "1")
    fully_async.reset()
    fully_async.STATE.tokenizer = None
    args = _fa_args(refusing.port, custom_generate_function_path=f"{__name__}.one_turn")
    out = generate_rollout_fully_async(args, 0, StandInDataSource([[BAD, 1], [1, 2], [3, 4]], 2))
    assert sorted(g[0].tokens[0] for g in out.samples) == [1, 3] and out.metrics["rollout/failed_groups"] == 1


def _abort(url):
    req = urllib.request.Request(url + "/abort_request", data=json.dumps({"abort_all": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def test_a_turn_an_engine_aborts_is_continued_not_handed_to_the_function_as_aborted(refusing):
    """The HANG group's first request gets 1 token, then the engine aborts it (slime's pause at a weight update
    aborts every request in flight): the front continues the turn from its tokens, so the function sees one
    answer of its whole budget, and the group is delivered once, never ABORTED."""
    fully_async.reset()
    fully_async.STATE.tokenizer = None
    args = _fa_args(refusing.port, custom_generate_function_path=f"{__name__}.one_turn", rollout_batch_size=1)
    src = StandInDataSource([[HANG, 3], [1, 2], [4, 5]], 2)
    outs = [generate_rollout_fully_async(args, 0, src)]
    _wait(lambda: any(b["input_ids"] == [HANG, 3] for b in refusing.worker.requests), "the HANG request")
    _abort(refusing.worker.url)
    outs += [generate_rollout_fully_async(args, step, src) for step in (1, 2)]
    hang = [g for out in outs for g in out.samples if g[0].tokens[0] == HANG]
    assert len(hang) == 1 and all(s.status.name == "TRUNCATED" and s.response_length == 4 for s in hang[0])
    assert sum(out.metrics["rollout/aborted_groups_rerun"] for out in outs) == 0
    delivered = [g[0].index for out in outs for g in out.samples]
    assert len(delivered) == len(set(delivered)) == 3


GAVE_UP = set()


async def aborts_once(args, sample, sampling_params):
    """Returns its sample ABORTED the first time (a function's own give-up), then generates it."""
    if sample.index not in GAVE_UP:
        GAVE_UP.add(sample.index)
        sample.status = Sample.Status.ABORTED
        return sample
    return await one_turn(args, sample, sampling_params)


def test_a_group_the_function_returns_aborted_is_run_again_not_delivered(refusing):
    """slime's fully-async puts a group with an ABORTED sample back in its buffer instead of training on it;
    the pool runs it again as it is, counted (rollout/aborted_groups_rerun)."""
    fully_async.reset()
    fully_async.STATE.tokenizer = None
    GAVE_UP.clear()
    args = _fa_args(refusing.port, custom_generate_function_path=f"{__name__}.aborts_once", rollout_batch_size=2)
    out = generate_rollout_fully_async(args, 0, StandInDataSource([[1, 2], [3, 4]], 2))
    assert len(out.samples) == 2 and out.metrics["rollout/aborted_groups_rerun"] == 2
    assert all(s.status.name == "TRUNCATED" and s.response_length == 4 for g in out.samples for s in g)


async def fan_out(args, sample, sampling_params):
    """Two turns, then the sample and a copy (slime's `list[Sample]` fan-out), both rewarded by --custom-rm-path."""
    sample = await two_turns(args, sample, sampling_params)
    twin = Sample(group_index=sample.group_index, index=sample.index, tokens=list(sample.tokens),
                  response_length=sample.response_length, loss_mask=list(sample.loss_mask),
                  status=Sample.Status.COMPLETED)
    return [sample, twin]


def test_a_functions_list_of_samples_is_kept_and_each_entry_carries_its_versions(one):
    """Before, the call's sort by index read the first entry's `index` (a list there) and raised."""
    args, src = _start(one.router.port, NORMAL[:4], custom_generate_function_path=f"{__name__}.fan_out",
                       custom_rm_path="test_slime_custom_generate.batch_reward")
    outs = [generate_rollout_fully_async(args, step, src) for step in (0, 1)]
    groups = [g for out in outs for g in out.samples]
    assert len(groups) == 4 and len({g[0][0].index for g in groups}) == 4
    for out in outs:
        assert [g[0][0].index for g in out.samples] == sorted(g[0][0].index for g in out.samples)
    for g in groups:
        for entry in g:
            assert len(entry) == 2
            for s in entry:
                assert s.metadata[SPANS] == [{"version": "1", "start": 0, "end": 2},
                                             {"version": "1", "start": 4, "end": 6}]
                assert s.weight_versions == ["1", "1"] and s.reward == 6.0
