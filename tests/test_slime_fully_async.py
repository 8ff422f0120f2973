"""slime's fully-async rollout (`rollout.slime.generate_rollout_fully_async`) on the manager, driven as slime's
`train_async.py` calls it: one call per step, a weight update between calls, the pool running in between.

The router and worker are STAND-INs (tests/test_slime_adapter.py's router; the worker below answers /generate
like SGLang 0.5.23: `meta_info.weight_version`, and `meta_info.weight_versions` spans when a request lived
across a weight update, in the shape SGLang's own `add_weight_versions_to_meta_info` writes; /model_info names
the version it serves). slime's types are the stand-in's (tests/support/slime_standin.py) where slime is not
importable. slime's own train_async.py loop: tests/test_slime_train_async.py.
"""
import asyncio
import copy
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web
from support import slime_standin  # noqa: F401 - slime's types under slime's names where slime is missing
from support.fake_sglang import FakeSGLang, answer
from test_slime_adapter import StandInDataSource, StandInRouter, length_reward  # noqa: F401

from rollout import versions
from rollout.slime import fully_async
from rollout.slime.fully_async import SPANS, generate_rollout_fully_async, staleness, version_spans
from rollout.types import Sample as ManagerSample

HOLD = 99   # a prompt starting with this token: its first request waits until `release()` (a long tail)


class VersionedWorker(FakeSGLang):
    """An SGLang worker whose weights are updated between steps (`update()`): each answer names the version
    that sampled it; a held request that lives across updates answers spans, half its tokens per version."""

    def __init__(self):
        super().__init__({"/generate": self.generate_versioned, "/model_info": self.model_version})
        self.version, self.requests, self.held = "1", [], []
        self.expired = 0    # held requests never released
        self.spans = True   # False: answer as 0.5.15.post1 / 0.5.16 do, the version at finish only
        self.gate = None

    def start(self):
        super().start()
        self.gate = asyncio.run_coroutine_threadsafe(_event(), self.loop).result(10)
        return self

    def update(self):
        self.version = str(int(self.version) + 1)

    def release(self):
        self.loop.call_soon_threadsafe(self.gate.set)

    def requests_of(self, first):
        return [b for b in self.requests if b["input_ids"][0] == first]

    async def model_version(self, request):
        return web.json_response({"weight_version": self.version})

    async def generate_versioned(self, request):
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        ids = body["input_ids"]
        if n > 0:
            self.requests.append(body)
        began = self.version
        if ids[0] == HOLD and n > 0 and self.held.count(tuple(ids)) < 2:   # both samples' first requests
            self.held.append(tuple(ids))
            try:
                await asyncio.wait_for(self.gate.wait(), 240)   # released by the test (a bound: never hangs)
            except asyncio.TimeoutError:
                self.expired += 1
                raise
        out = [(ids[-1] + 1 + i) % 300 for i in range(n)]
        meta = answer(out, {"type": "length"}, logprob=-0.5, weight_version=self.version,
                      prompt_tokens=len(ids))["meta_info"]
        if not self.spans:
            meta.pop("weight_versions")
        elif began != self.version and n > 1:   # SGLang >= 0.5.19: which tokens each version sampled
            meta["weight_versions"] = [{"version": began, "start": 0, "end": n // 2},
                                       {"version": self.version, "start": n // 2, "end": n}]
        else:
            meta["weight_versions"] = [{"version": self.version, "start": 0, "end": n}]
        return web.json_response({"text": "".join(f"<{t}>" for t in out), "meta_info": meta})


async def _event():
    return asyncio.Event()


@pytest.fixture
def stand():
    w = VersionedWorker().start()
    r = StandInRouter([(w.url, "regular")]).start()
    yield SimpleNamespace(worker=w, router=r)
    w.release()
    fully_async.reset()
    r.stop()
    w.stop()


def _args(port, **kw):
    base = dict(sglang_router_ip="127.0.0.1", sglang_router_port=port, n_samples_per_prompt=2,
                rollout_batch_size=2, sglang_server_concurrency=4, rollout_num_gpus=1,
                rollout_num_gpus_per_engine=1, use_rollout_routing_replay=False, rollout_temperature=1.0,
                rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=4,
                custom_rm_path=f"{__name__}.length_reward", hf_checkpoint=None, partial_rollout=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _steps(stand, prompts, steps, release_after=None, **kw):
    """train_async.py's order: the step's call, then a weight update; the long tail released after
    `release_after` updates. Returns each call's output and the version the engines served at each call."""
    fully_async.reset()
    fully_async.STATE.tokenizer = None   # prompts arrive as tokens
    args, src = _args(stand.router.port, **kw), StandInDataSource(prompts, 2)
    outs, served = [], []
    for step in range(steps):
        served.append(stand.worker.version)
        outs.append(generate_rollout_fully_async(args, step, src))
        stand.worker.update()
        if release_after is not None and step + 1 == release_after:
            stand.worker.release()
    return outs, served


def _oldest(group) -> int:
    return min(int(s["version"]) for x in group for s in x.metadata[SPANS])


def _stale_delivered(outs, served, lag) -> list:
    """Groups delivered with a token older than the served version minus `lag` (what the bound forbids)."""
    return [(step, g[0].index, _oldest(g)) for step, (out, v) in enumerate(zip(outs, served))
            for g in out.samples if _oldest(g) < int(v) - lag]


PROMPTS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def test_each_call_returns_the_batch_every_group_once_across_three_updates(stand):
    outs, served = _steps(stand, PROMPTS, 4)
    delivered = [g[0].index for out in outs for g in out.samples]
    assert all(len(out.samples) == 2 for out in outs)
    assert len(delivered) == len(set(delivered)) == 8       # every group once, none lost
    for out in outs:
        assert [g[0].index for g in out.samples] == sorted(g[0].index for g in out.samples)
        for g in out.samples:
            for s in g:
                assert s.response_length == 4 and s.reward == 4.0 and s.status.name == "TRUNCATED"
                spans = s.metadata[SPANS]
                assert spans[0]["start"] == 0 and spans[-1]["end"] == s.response_length   # every token
                assert s.weight_versions == [spans[-1]["version"]]                      # slime's, one per answer
        m = out.metrics
        assert m["rollout/groups"] == m["rollout/groups_on_one_rank"] == 2 and m["rollout/stale_groups"] == 0
    assert outs[0].metrics["rollout/pool_groups"] == 2   # concurrency 4 x 1 engine / 2 samples per group
    # the pool ran between the calls: groups were already in flight or finished when a call began
    assert outs[0].metrics["rollout/in_flight_groups"] + outs[0].metrics["rollout/ready_groups"] > 0


def test_a_group_older_than_the_lag_is_regenerated_not_delivered(stand):
    """The long-tail group started under version 1 and finished under 3 (tokens of 1 and 3): with lag 1 it
    is generated again from its prompt under the current weights, counted, and delivered once."""
    outs, served = _steps(stand, [[HOLD, 1]] + PROMPTS[:5], 3, release_after=2, max_weight_version_lag=1)
    assert _stale_delivered(outs, served, 1) == []
    held = [g for out in outs for g in out.samples if g[0].tokens[0] == HOLD]
    assert len(held) == 1 and {s["version"] for x in held[0] for s in x.metadata[SPANS]} == {"3"}
    assert sum(out.metrics["rollout/stale_groups"] for out in outs) == 1
    assert sum(out.metrics["rollout/stale_regenerated"] for out in outs) == 1
    assert sum(out.metrics["rollout/stale_tokens"] for out in outs) == 2 * 4   # both samples' responses
    delivered = [g[0].index for out in outs for g in out.samples]
    assert len(delivered) == len(set(delivered)) == 6


def test_without_the_bound_the_stale_group_is_delivered(stand):
    """The same run without max_weight_version_lag: the long-tail group reaches the trainer with tokens two
    versions old (what `_stale_delivered` catches above)."""
    outs, served = _steps(stand, [[HOLD, 1]] + PROMPTS[:5], 3, release_after=2)
    stale = _stale_delivered(outs, served, 1)
    assert len(stale) == 1 and stale[0][2] == 1, stale
    assert all(out.metrics["rollout/stale_groups"] == 0 for out in outs)


def test_an_answer_without_spans_is_bounded_by_the_version_its_group_started_under(stand):
    """0.5.15.post1 / 0.5.16 (slime's image) name only the version at finish: the long tail says "3" for every
    token, yet it began under 1. The group is taken to be as old as the version current when it started."""
    stand.worker.spans = False
    outs, served = _steps(stand, [[HOLD, 1]] + PROMPTS[:5], 3, release_after=2, max_weight_version_lag=1)
    assert sum(out.metrics["rollout/stale_regenerated"] for out in outs) == 1
    assert len(stand.worker.requests_of(HOLD)) == 4   # both samples generated again, not delivered as they were


def test_drop_policy_drops_the_stale_group_and_counts_it(stand):
    outs, served = _steps(stand, [[HOLD, 1]] + PROMPTS[:5], 3, release_after=2, max_weight_version_lag=1,
                          stale_groups="drop")
    assert _stale_delivered(outs, served, 1) == []
    assert not [g for out in outs for g in out.samples if g[0].tokens[0] == HOLD]
    assert sum(out.metrics["rollout/stale_dropped"] for out in outs) == 1


def test_a_ready_group_that_went_stale_while_waiting_is_not_handed_out(stand):
    """Groups finished under version 1 wait in the pool while two updates pass (lag 0 here): at hand-out
    they are regenerated, never delivered."""
    fully_async.reset()
    fully_async.STATE.tokenizer = None
    args, src = _args(stand.router.port, max_weight_version_lag=0), StandInDataSource(PROMPTS, 2)
    first = generate_rollout_fully_async(args, 0, src)
    for _ in range(200):   # up to 10 s: the pool finishes the next groups under version 1
        if fully_async._POOL.ready:
            break
        time.sleep(0.05)
    assert fully_async._POOL.ready
    stand.worker.update()
    second = generate_rollout_fully_async(args, 1, src)
    for out, v in ((first, 1), (second, 2)):
        assert all(_oldest(g) == v for g in out.samples)
    assert second.metrics["rollout/stale_groups"] >= 1


def test_version_spans_follow_sglangs_own_spans():
    """The spans SGLang's own code writes (0.5.19+: sglang.srt.utils.weight_versions) for a request that lived
    across an update, read back per token; an older release's single version; tokens held from slime's buffer."""
    wv = pytest.importorskip("sglang.srt.utils.weight_versions")
    events = [wv.WeightVersionEvent(old_version="3", num_output_tokens=2)]
    meta = {}
    wv.add_weight_versions_to_meta_info(meta, wv.compute_weight_version_spans(events, "4", 5), 5)
    ms = ManagerSample("g/0", "g", 0, [1, 2], response_ids=[9, 9, 9] + [5] * 5 + [6] * 2)
    for n, answer_meta in ((5, meta), (2, {"weight_version": "5"})):   # as the dispatcher notes each answer
        versions.note(ms, n, answer_meta)
    assert version_spans(ms, "2") == [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5},
                                      {"version": "4", "start": 5, "end": 8}, {"version": "5", "start": 8, "end": 10}]


def test_staleness_settings_and_bad_values(monkeypatch, tmp_path):
    monkeypatch.delenv(fully_async.LAG_ENV, raising=False)
    monkeypatch.delenv(fully_async.POLICY_ENV, raising=False)
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_CONFIG", raising=False)
    assert staleness(SimpleNamespace()) == (None, "regenerate")
    assert staleness(SimpleNamespace(max_weight_version_lag=2, stale_groups="drop")) == (2, "drop")
    monkeypatch.setenv(fully_async.LAG_ENV, "1")
    assert staleness(SimpleNamespace(max_weight_version_lag=2)) == (1, "regenerate")
    monkeypatch.setenv(fully_async.LAG_ENV, "x")
    with pytest.raises(ValueError, match=r"max_weight_version_lag 'x' is not an integer"):
        staleness(SimpleNamespace())
    monkeypatch.delenv(fully_async.LAG_ENV)
    with pytest.raises(ValueError, match=r"stale_groups 'later': give one of regenerate, drop"):
        staleness(SimpleNamespace(stale_groups="later"))
    from training_configs.schema import load_config
    cfg = tmp_path / "c.yaml"
    text = (Path(__file__).resolve().parents[1] / "training_configs" / "tiny-cpu.yaml").read_text()
    cfg.write_text(text.replace("\nrollout:\n", "\nrollout:\n  max_weight_version_lag: 3\n  stale_groups: drop\n", 1))
    assert load_config(str(cfg)).rollout.max_weight_version_lag == 3
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_CONFIG", str(cfg))
    assert staleness(SimpleNamespace()) == (3, "drop")


def test_the_pool_is_sized_by_engines_and_dp_ranks():
    backend = SimpleNamespace(n_samples=4, options=SimpleNamespace(concurrency=8), layout=None,
                              dispatcher=SimpleNamespace(slots={
                                  "a": SimpleNamespace(capacity=8, dp_ranks=4), "b": SimpleNamespace(capacity=8,
                                                                                                    dp_ranks=4)}))
    pool = fully_async.Pool(SimpleNamespace(), backend, None, None)
    pool.sized(2)
    assert pool.size == 8   # 2 engines x 4 ranks (more than 16 in flight / 4 per group)
    backend.dispatcher.slots = {"a": SimpleNamespace(capacity=64, dp_ranks=1)}
    pool.sized(2)
    assert pool.size == 16
    assert copy.copy(pool.stale) == {"regenerate": 0, "drop": 0}


def record_filter(args, data):
    raise AssertionError("the fully-async rollout ran the sample filter")


@pytest.mark.timeout(60)
def test_filters_slime_fully_async_does_not_run_are_named_once_not_run(stand, capsys):
    """slime's fully_async_rollout runs neither --rollout-sample-filter-path nor --rollout-all-samples-process-path:
    neither runs here, and the first call says so in one line (not on the next calls)."""
    kw = dict(rollout_sample_filter_path=f"{__name__}.record_filter",
              rollout_all_samples_process_path=f"{__name__}.record_filter")
    outs, _ = _steps(stand, PROMPTS, 2, **kw)
    assert all(len(out.samples) == 2 for out in outs)
    lines = [l for l in capsys.readouterr().err.splitlines() if "fully-async rollout" in l]
    assert lines == ["slime-moe-rollout: warning: --rollout-sample-filter-path, --rollout-all-samples-process-path "
                     "not run by the fully-async rollout (slime's own fully_async_rollout runs neither)"]
