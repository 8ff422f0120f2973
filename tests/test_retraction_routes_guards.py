"""retraction-routes / retraction-rows inside SGLang's processes (issue: wrong rows under a world DP gather,
unguarded hooks, unbounded kept rows). Pure checks on the hook bodies; the release scenarios are in
test_retraction_rows.py."""
import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_patches.fixes import retraction_routes as rr
from sglang_patches.fixes import retraction_rows as rows
from sglang_patches.fixes.retraction_rows import KEPT

pytestmark = pytest.mark.timeout(60)
DP = dict(enable_dp_attention=True, enable_return_routed_experts=True, moe_a2a_backend="none")


class Req(SimpleNamespace):
    __hash__ = object.__hash__


def _batch(kept):
    return SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), prefix_lens=[0], extend_lens=[4],
                           reqs=[Req(**{KEPT: kept})], is_extend_in_batch=True)


def test_world_dp_gather_forces_no_rows(monkeypatch, caplog):
    """A world DP gather: the routers see every rank's rows, so no plan (this rank's local one included) is set,
    and the log line says so. b76cc10 set the local plan (rows 0-3) on the gathered rows."""
    monkeypatch.setattr(rr, "_dpa", lambda: SimpleNamespace(world_dp_gather_enabled=lambda: True))
    rr._said.clear()
    seen = []
    scheduler = SimpleNamespace(server_args=SimpleNamespace(**DP), tp_cpu_group=None)
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        rr.plan_on_run_batch(lambda s, b: seen.append((rr._plan, rr._dp_plans)), scheduler,
                             _batch((0, torch.zeros((4, 2, 2), dtype=torch.int32))))
    assert seen == [(None, None)], f"forced rows {seen[0][0][0].tolist()} in a world DP gather"
    assert [r.getMessage() for r in caplog.records] == [rr.NOT_FORCED % "the DP gather spans the whole world "
                                                                         "(elastic scale-up)"]


def test_dp_attention_without_exchange_never_uses_the_local_plan(monkeypatch):
    """DP attention with an all-to-all backend: no plan in either form."""
    monkeypatch.setattr(rr, "_dpa", lambda: SimpleNamespace(world_dp_gather_enabled=lambda: False))
    scheduler = SimpleNamespace(server_args=SimpleNamespace(**{**DP, "moe_a2a_backend": "deepep"}))
    assert rr.step_plans(scheduler, _batch((0, torch.zeros((4, 2, 2), dtype=torch.int32)))) == (None, None)


def test_a_failing_plan_never_reaches_the_scheduler(caplog):
    """Kept rows of another shape than the batch's (our own code raises): the batch runs unplanned, one line."""
    broken = _batch((0, torch.zeros((4, 2, 2), dtype=torch.int32)))
    broken.reqs.append(Req(**{KEPT: (0, torch.zeros((4, 3, 2), dtype=torch.int32))}))
    broken.prefix_lens, broken.extend_lens = [0, 0], [4, 4]
    scheduler = SimpleNamespace(server_args=SimpleNamespace(enable_dp_attention=False))
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        assert rr.plan_on_run_batch(lambda s, b: (rr._plan, "ran"), scheduler, broken) == (None, "ran")
    assert "the plan failed (RuntimeError" in caplog.records[-1].getMessage()


def test_a_failing_force_keeps_sglangs_choice(caplog):
    """A kept expert the router does not have (our weights' gather raises): SGLang's ids pass on, one line."""
    logits = torch.randn(4, 8)
    ids, weights = logits.topk(2, -1).indices, logits.sigmoid().topk(2, -1).values
    rr._plan = (torch.tensor([1]), torch.full((1, 1, 2), 99, dtype=torch.int32))
    cfg = SimpleNamespace(correction_bias=torch.zeros(8), renormalize=True)
    try:
        with caplog.at_level("WARNING", logger="slime_moe_rollout"):
            got = rr.force_on_post_process(lambda **kw: kw["topk_ids"], router_logits=logits, topk_ids=ids,
                                           topk_weights=weights, topk_config=cfg, layer_id=0)
    finally:
        rr._plan = None
    assert got is ids
    assert "forcing layer 0 failed (RuntimeError" in caplog.records[-1].getMessage()


def _capturer(n_slots=64):
    buf = torch.arange(n_slots * 2, dtype=torch.int32).reshape(n_slots, 1, 2)
    return SimpleNamespace(get_topk=lambda req_pool_idx, seqlen, req_to_token_pool, start_len:
                           buf[req_to_token_pool.req_to_token[req_pool_idx][start_len:seqlen - 1]])


def _live_req(rid, n_out=3):
    return Req(rid=rid, return_routed_experts=True, origin_input_ids=[1, 2, 3, 4], output_ids=[7] * n_out,
               routed_experts_start_len=0, sampling_params=SimpleNamespace(custom_params=None), req_pool_idx=0)


def _release(req, capturer, monkeypatch):
    from sglang.srt.state_capturer import routed_experts as re_mod

    monkeypatch.setattr(re_mod, "get_global_experts_capturer", lambda: capturer)
    pool = SimpleNamespace(req_to_token=torch.arange(128).reshape(2, 64))
    return rows.keep_on_release_req_idx(lambda **kw: "released", req=req, req_to_token_pool=pool)


def test_kept_rows_capped_per_request(monkeypatch, caplog):
    """6 rows of 8 bytes over a 40-byte cap: none kept, the request marked off, one line; b76cc10 kept them."""
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_KEPT_MB_PER_REQUEST", str(40 / (1 << 20)))
    req = _live_req("r-big")
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        assert _release(req, _capturer(), monkeypatch) == "released"
    assert getattr(req, KEPT, None) is None, "kept rows past the per-request cap"
    assert "would take" in getattr(req, rows.OFF) and len(caplog.records) == 1
    assert "request r-big" in caplog.records[0].getMessage()


def test_kept_rows_capped_per_process(monkeypatch):
    """Two live requests of 48 bytes under a 80-byte process cap: the first keeps, the second does not."""
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_KEPT_MB_PER_PROCESS", str(80 / (1 << 20)))
    first, second = _live_req("a"), _live_req("b")
    _release(first, _capturer(), monkeypatch)
    _release(second, _capturer(), monkeypatch)
    assert getattr(first, KEPT)[1].nbytes == 48
    assert getattr(second, KEPT, None) is None, "kept rows past the per-process cap"
    assert rows.held_bytes() == 48
    del first   # a finished or aborted request frees its share
    import gc
    gc.collect()
    assert rows.held_bytes() == 0


def test_a_failing_keep_never_reaches_the_scheduler(monkeypatch):
    """A capturer that cannot read its rows: release_req still runs, the request's rows are SGLang's."""
    def broken(**kw):
        raise IndexError("no such slot")
    req = _live_req("r-broken")
    assert _release(req, SimpleNamespace(get_topk=broken), monkeypatch) == "released"
    assert getattr(req, KEPT, None) is None and "keeping its rows failed (IndexError" in getattr(req, rows.OFF)


def test_a_failing_stamp_passes_the_answer(caplog):
    import asyncio

    class Meta(dict):
        def __setitem__(self, k, v):
            raise TypeError("read-only")

    async def answers():
        yield {"meta_info": Meta(routed_experts="AAAA")}
        yield {"meta_info": {"routed_experts": "AAAA"}}

    async def collect():
        obj = SimpleNamespace(rid="r1", sampling_params={})
        return [o async for o in rows.state_rule(answers(), None, obj)]
    with caplog.at_level(logging.WARNING, logger="slime_moe_rollout"):
        got = asyncio.run(collect())
    assert len(got) == 2 and rows.META_KEY not in got[1]["meta_info"]   # off for the rest of the request
    assert "stamping its answer failed (TypeError" in caplog.records[-1].getMessage()
