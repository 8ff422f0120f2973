"""retraction-rows and retraction-routes on every reviewed SGLang variant: `sglang_patches/scenarios/retraction.py`
runs SGLang's own `release_req` / `Req.reset_for_retract` / `get_topk` / `_maybe_collect_routed_experts`,
`Scheduler.run_batch` (the plan hook) with `select_experts`, and `TokenizerManager._wait_one_response` (the state
hook) in the variant's environment (0.5.23: the main one), stock and then with the plugin loaded by SGLang's
`load_plugins()`. Stock SGLang returns the re-prefill's rows for the positions sampled before a retraction, its
re-prefill routes those positions again, and its answers carry no `routed_experts_retraction` (the needles); with
the plugin, the rows those tokens were sampled with, the re-prefill routes with them, and the answer names the
rule. `patches status` lists both fixes active there.
"""
import json
import subprocess

import pytest

from sglang_patches.registry import VARIANTS
from sglang_patches.scenarios import retraction as rs
from sglang_patches.scenarios.runner import ROOT
from support.gloo import run_ranks
from support.variant_runs import python_of, scenarios

FIX = "retraction-rows"
ROUTES = "retraction-routes"
ALL = [v.name for v in VARIANTS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ALL)
def test_retraction_rows_on_variant(variant):
    res = scenarios(variant)   # the retraction list runs with the others (scenarios/every.py)
    assert {FIX, ROUTES} <= set(res["plugin"]["_meta"]["registered"]) and res["none"]["_meta"]["registered"] == []
    for name, needle in rs.EXPECT_STOCK.items():
        stock, fixed = res["none"][name], res["plugin"][name]
        assert not stock["ok"] and needle in stock["detail"], f"{name}: stock SGLang {variant}: {stock}"
        assert fixed["ok"], f"{name}: still wrong with the plugin on {variant}: {fixed}"
    for name in rs.GUARDS:
        for state in ("none", "plugin"):
            assert res[state][name]["ok"], f"{name} ({state}, {variant}): {res[state][name]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["0.5.23"])   # the other variants: test_version_matrix's status test
def test_retraction_rows_status_on_variant(variant):
    r = subprocess.run([str(python_of(variant)), "-m", "rollout.cli", "patches", "status", "--json"],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    report = json.loads(r.stdout)
    assert report["variant"] == variant, report["variant_problem"]
    rows = {f["name"]: (f["family"], f["state"], f["reason"]) for f in report["fixes"] if f["name"] in (FIX, ROUTES)}
    assert rows == {FIX: ("r3", "active", "3 hook(s)"), ROUTES: ("r3", "active", "3 hook(s)")}


def test_splice_and_keep_bounds():
    """The pure row rules: kept rows win for their positions only; a later retraction appends after them."""
    import torch

    from sglang_patches.fixes.retraction_rows import keep, splice

    rows = lambda *ids: torch.tensor(ids, dtype=torch.int32)[:, None, None]  # noqa: E731
    kept = keep(None, 2, rows(12, 13))
    kept = keep(kept, 2, rows(92, 93, 14, 15))
    assert kept[0] == 2 and kept[1].flatten().tolist() == [12, 13, 14, 15]
    assert splice(rows(90, 91, 92, 93, 94, 95, 96), 0, kept).flatten().tolist() == [90, 91, 12, 13, 14, 15, 96]
    assert splice(rows(93, 94), 3, kept).flatten().tolist() == [13, 14]   # collected from a later start
    assert splice(rows(97), 7, kept).flatten().tolist() == [97]            # nothing to replace
    with pytest.raises(ValueError, match="leave a gap"):
        keep(kept, 9, rows(1))


def test_meta_info_states_the_rule():
    """The tokenizer-manager hook: answers carrying routed experts name the rule of the request (its custom_params);
    others pass unchanged. (On a real engine: tests/test_retraction_rows_engine.py reads the key from /generate.)"""
    import asyncio
    from types import SimpleNamespace

    from sglang_patches.fixes.retraction_rows import META_KEY, RECOMPUTED, RULE_KEY, SAMPLING_TIME, state_rule

    async def answers():
        yield {"meta_info": {"routed_experts": None}}
        yield {"meta_info": {"routed_experts": "AAAA"}}

    async def collect(custom_params):
        obj = SimpleNamespace(sampling_params={"custom_params": custom_params})
        return [out["meta_info"].get(META_KEY) async for out in state_rule(answers(), None, obj)]

    assert asyncio.run(collect(None)) == [None, SAMPLING_TIME]
    assert asyncio.run(collect({RULE_KEY: RECOMPUTED})) == [None, RECOMPUTED]


def test_the_stamp_follows_the_schedulers_word():
    """The stamp is earned: a retracted answer is stamped from the word the scheduler sent in customized_info (the
    last word of the accumulated per-token list), and without a word it carries no stamp; an answer never
    retracted is sampling-time; an opt-out is recomputed, asked."""
    from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, META_KEY, RECOMPUTED, SAMPLING_TIME, stamp

    kept = {"rule": SAMPLING_TIME, "retractions": 2, "kept_rows": 6}
    off = {"rule": RECOMPUTED, "why": "its kept rows would take 9 MB"}
    for words, rule in (([None, None, kept], SAMPLING_TIME), ([None, off], RECOMPUTED)):
        meta = {"routed_experts": "AAAA", "num_retractions": 2, EVIDENCE_KEY: words}
        stamp(meta, SAMPLING_TIME)
        assert (meta[META_KEY], meta[EVIDENCE_KEY]) == (rule, words[-1])
    meta = {"routed_experts": "AAAA", "num_retractions": 1}
    stamp(meta, SAMPLING_TIME)
    assert META_KEY not in meta and EVIDENCE_KEY not in meta   # retracted, the scheduler said nothing
    meta = {"routed_experts": "AAAA", "num_retractions": 0}
    stamp(meta, SAMPLING_TIME)
    assert meta == {"routed_experts": "AAAA", "num_retractions": 0, META_KEY: SAMPLING_TIME}
    meta = {"routed_experts": "AAAA", "num_retractions": 1}
    stamp(meta, RECOMPUTED)
    assert meta[EVIDENCE_KEY] == {"rule": RECOMPUTED, "asked": True}


def test_the_word_rides_on_customized_info_to_the_last_token():
    """The scheduler's word: one value per output token (the streamer slices each chunk from send_token_offset),
    the word at the last; nothing for a request the fix never saw retracted or with no output."""
    from types import SimpleNamespace

    from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, send_evidence

    req = SimpleNamespace(output_ids_through_stop=[5, 6, 7], customized_info=None)
    send_evidence(req, {"rule": "sampling-time"})
    assert req.customized_info == {EVIDENCE_KEY: [None, None, {"rule": "sampling-time"}]}
    assert req.customized_info[EVIDENCE_KEY][2:3] == [{"rule": "sampling-time"}]   # the last chunk's slice
    for word, out in ((None, [1]), ({"rule": "x"}, [])):
        req = SimpleNamespace(output_ids_through_stop=out, customized_info=None)
        send_evidence(req, word)
        assert req.customized_info is None


def test_the_reprefill_disagreement_counts_expert_sets():
    """The scheduler's count behind reprefill_agreement: kept token-layer rows whose collected (re-prefill) experts
    form another set; the order inside a row is not a different route; positions outside the kept rows are not
    compared."""
    import torch

    from sglang_patches.fixes.retraction_rows import disagree

    kept = (1, torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], dtype=torch.int32))   # positions 1, 2; 2 layers
    collected = torch.tensor([[[9, 9], [9, 9]], [[2, 1], [3, 5]], [[5, 6], [0, 7]], [[8, 8], [8, 8]]],
                             dtype=torch.int32)   # positions 0..3
    assert disagree(collected, 0, kept) == (1, 4)   # position 1 layer 1 routes {3, 5}, not {3, 4}
    assert disagree(collected[3:], 3, kept) == (0, 0)


# what carries a Req's customized_info from the scheduler to the answer's meta_info on every reviewed release
CHANNEL = {
    "managers/scheduler_components/output_streamer.py": ("req.customized_info.items()",
                                                         "req_values[send_token_offset : len(output_ids_)]",
                                                         "wrap_as_pickle(self.customized_info)"),
    "managers/detokenizer_manager.py": ("customized_info=recv_obj.customized_info",),
    "managers/tokenizer_manager.py": ("customized_info = unwrap_from_pickle(recv_obj.customized_info)",),
}
ACCUMULATE = (("state.customized_info_accumulated[k].extend(v[i])",          # 0.5.15.post1-0.5.18
               "meta_info[k] = state.customized_info_accumulated[k]"),
              ("accumulated.extend(values)", "meta_info[key] = accumulated"))   # 0.5.19+


@pytest.mark.parametrize("variant", ALL)
def test_customized_info_reaches_meta_info_on_variant(variant):
    """The channel the earned stamp rides on, pinned in each release's own source: the streamer sends each
    per-token customized_info key's slice, BatchTokenIDOutput and BatchStrOutput carry it, the detokenizer passes
    it on, and the tokenizer manager accumulates it into meta_info[key] (scenario `retraction_state_capped` runs
    the ends through SGLang's own code; the transport is this)."""
    import glob

    srt = glob.glob(str(python_of(variant).parent.parent / "lib" / "python3*" / "site-packages" / "sglang" / "srt"))
    assert srt, f"no sglang tree for {variant}"
    for rel, needles in CHANNEL.items():
        text = open(f"{srt[0]}/{rel}").read()
        for needle in needles:
            assert needle in text, f"{variant} {rel}: {needle!r} missing"
    text = open(f"{srt[0]}/managers/tokenizer_manager.py").read()
    assert any(all(n in text for n in pair) for pair in ACCUMULATE), f"{variant}: the tokenizer no longer accumulates"
    io = open(f"{srt[0]}/managers/io_struct.py").read()
    assert io.count("customized_info: Optional[PickleWrapper] = None") >= 2   # BatchTokenIDOutput, BatchStrOutput


def _req(kept=None):
    from types import SimpleNamespace

    from sglang_patches.fixes.retraction_rows import KEPT

    return SimpleNamespace(**({KEPT: kept} if kept is not None else {}))


def test_plan_covers_the_kept_positions_the_batch_computes():
    """Batch rows of the positions that have kept rows: after the earlier requests' rows, from the prefix on (a
    chunked or cached prefix computes nothing), never past the kept rows (the last position is new)."""
    import torch

    from sglang_patches.fixes.retraction_routes import plan_of

    kept = torch.arange(6 * 2 * 2, dtype=torch.int32).reshape(6, 2, 2)     # positions 0..5
    rows, experts = plan_of([_req(), _req((0, kept)), _req((2, kept[:3]))], [0, 2, 3], [3, 5, 4])
    # request 1: positions 2..6 at rows 3..7, kept 2..5 -> rows 3..6; request 2: positions 3..6 at rows 8..11,
    # kept 2..4 -> positions 3, 4 -> rows 8, 9
    assert rows.tolist() == [3, 4, 5, 6, 8, 9]
    assert experts.tolist() == kept[2:6].tolist() + kept[1:3].tolist()
    assert plan_of([_req(), _req((0, kept))], [0, 6], [3, 1]) is None       # only the new position computed


def test_kept_weights_follow_the_router_and_refuse_another_formula():
    """The kept experts' weights: the router's scores there, renormalized, with SGLang's scale read from the
    experts it chose; None where the formula does not reproduce SGLang's weights."""
    from types import SimpleNamespace

    import torch

    from sglang_patches.fixes.retraction_routes import kept_weights

    torch.manual_seed(0)
    logits, rows = torch.randn(3, 8), torch.tensor([1, 2])
    cfg = SimpleNamespace(correction_bias=torch.zeros(8), renormalize=True)
    ids = logits.topk(2, -1).indices
    scores = logits.sigmoid().gather(1, ids)
    weights = 2.5 * scores / scores.sum(-1, keepdim=True)                   # routed scaling on the output
    kept = torch.tensor([[0, 1], [2, 3]])
    want = logits[1:].sigmoid().gather(1, kept)
    got = kept_weights(cfg, logits, rows, ids, weights, kept)
    assert torch.allclose(got, 2.5 * want / want.sum(-1, keepdim=True))
    softmax = logits.softmax(-1).gather(1, ids)                              # not this config's formula
    assert kept_weights(cfg, logits, rows, ids, softmax, kept) is None


def _batch(kept=None, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), prefix_lens=[0], extend_lens=[3],
                           reqs=[_req(kept)], **kw)


def test_no_plan_where_an_all_to_all_backend_splits_the_tokens(caplog):
    """All-to-all backends: no plan, one log line naming why."""
    from types import SimpleNamespace

    import torch

    from sglang_patches.fixes import retraction_routes as rr

    batch = _batch((0, torch.zeros((4, 2, 2), dtype=torch.int32)))
    rr._said.clear()
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        assert rr._batch_plan(SimpleNamespace(moe_a2a_backend="deepep"), batch) is None
        assert rr._batch_plan(SimpleNamespace(moe_a2a_backend="deepep"), batch) is None
        assert rr._batch_plan(SimpleNamespace(moe_a2a_backend="none"), batch)[0].tolist() == [0, 1, 2]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "all-to-all" in lines[0], lines


def test_dp_ranks_exchange_only_in_steps_every_rank_runs():
    """Under DP attention the plans are exchanged in extend steps (idle ranks run them too) of an engine that
    returns routed experts, and never with an all-to-all backend: the answer is the same on every rank."""
    from types import SimpleNamespace

    from sglang_patches.fixes.retraction_routes import _exchanges

    dp = dict(enable_dp_attention=True, enable_return_routed_experts=True, moe_a2a_backend="none")
    idle = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False), reqs=[], is_extend_in_batch=True)
    assert _exchanges(SimpleNamespace(**dp), idle)
    assert not _exchanges(SimpleNamespace(**dp), SimpleNamespace(is_extend_in_batch=False))
    assert not _exchanges(SimpleNamespace(**dp), None)
    assert not _exchanges(SimpleNamespace(**{**dp, "enable_return_routed_experts": False}), idle)
    assert not _exchanges(SimpleNamespace(**{**dp, "moe_a2a_backend": "deepep"}), idle)
    assert not _exchanges(SimpleNamespace(**{**dp, "enable_dp_attention": False}), idle)


def test_gathered_plan_places_each_slot_after_the_earlier_counts(caplog):
    """Slot d's rows follow the earlier slots' token counts (padded or not); a skipped gather holds this slot's
    rows alone; counts that do not cover the routers' rows give no plan and one line."""
    import torch

    from sglang_patches.fixes import retraction_routes as rr

    k0, k1 = torch.zeros((1, 2, 2), dtype=torch.int32), torch.ones((2, 2, 2), dtype=torch.int32)
    plans = {0: (torch.tensor([2]), k0), 1: (torch.tensor([0, 3]), k1)}
    rows, kept = rr.gathered_plan(plans, [3, 7], 1, 10)
    assert rows.tolist() == [2, 3, 6] and kept.tolist() == k0.tolist() + k1.tolist()
    assert rr.gathered_plan(plans, [7, 7], 1, 14)[0].tolist() == [2, 7, 10]
    assert rr.gathered_plan(plans, [7], 1, 7)[0].tolist() == [0, 3]
    rr._said.clear()
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        assert rr.gathered_plan(plans, [3, 7], 1, 7) is None
    assert "the routers' 7 rows do not match the DP gather's counts [3, 7]" in caplog.records[0].getMessage()


def _exchange_rank(rank):
    """One DP rank of a real 2-process gloo group: rank 0 re-prefills a retracted request, rank 1 runs the step
    idle, and its plan fails (it must still join the exchange). Each returns the plan its first router places."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from sglang_patches.fixes import retraction_routes as rr

    rr.own_slot = lambda: rank
    rr._dpa = lambda: SimpleNamespace(get_dp_global_num_tokens=lambda: [3, 4])
    args = SimpleNamespace(enable_dp_attention=True, enable_return_routed_experts=True, moe_a2a_backend="none")
    if rank == 0:
        batch = _batch((1, torch.full((2, 2, 2), 5, dtype=torch.int32)), is_extend_in_batch=True)
    else:
        def broken():
            raise ValueError("no mode")
        batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=broken), reqs=[], is_extend_in_batch=True)
    scheduler = SimpleNamespace(server_args=args, tp_cpu_group=dist.group.WORLD)
    rows, kept = rr.plan_on_run_batch(lambda self, b: rr._placed(torch.zeros(7, 8)), scheduler, batch)
    return rows.tolist(), kept[:, 0, 0].tolist()


@pytest.mark.timeout(180)
def test_dp_ranks_exchange_their_plans_over_a_real_group():
    """Two processes, a real gloo exchange: both ranks place rank 0's kept rows (positions 1, 2 of its 3-token
    extend) at the same gathered rows, though rank 1 is idle and its own plan failed."""
    got = run_ranks(_exchange_rank, budget_s=150)
    assert got == [(0, "ok", ([1, 2], [5, 5])), (1, "ok", ([1, 2], [5, 5]))], got


def _slot_rank(rank):
    """One rank of 4 (DP slots 0, 0, 1, 1): each slot's two ranks hold the same plan. Returns the plans it got in
    a step with plans and in one without, and which ranks broadcast in each."""
    import torch
    import torch.distributed as dist

    from sglang_patches.fixes import retraction_routes as rr

    sent = []
    broadcast = dist.broadcast_object_list
    dist.broadcast_object_list = lambda box, **kw: (sent.append(kw["src"]), broadcast(box, **kw))[1]
    plans = {0: (torch.tensor([1, 2]), torch.full((2, 3, 2), 159, dtype=torch.int32)),
             1: (torch.tensor([0]), torch.full((1, 3, 2), 300, dtype=torch.int32))}
    got = rr.exchange(dist.group.WORLD, rank // 2, plans[rank // 2])
    with_plans = {s: (r.tolist(), str(r.dtype), k.unique().tolist(), str(k.dtype)) for s, (r, k) in got.items()}
    senders, sent[:] = list(sent), []
    return with_plans, senders, rr.exchange(dist.group.WORLD, rank // 2, None), sent


@pytest.mark.timeout(180)
def test_one_rank_per_dp_slot_sends_its_plan():
    """4 ranks, 2 DP slots: every rank gets both slots' plans, in their own types, from one broadcast per slot
    (by the slot's first rank: 2 sends, not 4); a step without plans broadcasts nothing."""
    want = {0: ([1, 2], "torch.int64", [159], "torch.int32"), 1: ([0], "torch.int64", [300], "torch.int32")}
    got = run_ranks(_slot_rank, world=4, budget_s=150)
    assert got == [(r, "ok", (want, [0, 2], None, [])) for r in range(4)], got


def test_kept_experts_travel_narrowed():
    import torch

    from sglang_patches.fixes.retraction_routes import narrow

    got = {v: str(narrow(torch.tensor([[0, v]], dtype=torch.int32)).dtype) for v in (159, 255, 300, -1, 70000)}
    assert got == {159: "torch.uint8", 255: "torch.uint8", 300: "torch.int16", -1: "torch.int16",
                   70000: "torch.int32"}


def test_a_plan_no_router_took_is_said_once(caplog):
    """A batch whose routers never reach the post-processing (a CUDA-graphed prefill, a fused router): one line."""
    from types import SimpleNamespace

    import torch

    from sglang_patches.fixes import retraction_routes as rr

    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), prefix_lens=[0], extend_lens=[3],
                            reqs=[_req((0, torch.zeros((4, 2, 2), dtype=torch.int32)))])
    scheduler = SimpleNamespace(server_args=SimpleNamespace(enable_dp_attention=False))
    rr._said.clear()
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        for _ in range(2):
            assert rr.plan_on_run_batch(lambda self, b: "ran", scheduler, batch) == "ran"
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "a retracted request's re-prefill routes as SGLang chooses: no router passed select_experts' "
        "post-processing (a CUDA-graphed prefill or a fused router)"]
    assert rr._plan is None
