"""Configuration (c), the seed shape in miniature, on real SGLang CPU (`make test-e2e`).

DP attention tp 4 / dp 2 (attn_tp 2), ep 4, moe-dense-tp 1, dp-lm-head, NEXTN (2 steps, top-k 1,
3 draft tokens: 3 does not divide attn_tp 2) and routed experts, on the always-match model.
Every DP rank is pinned in turn (`routed_dp_rank`) and compared with transformers.
"""
import pytest
from support.engines import active_fixes, generate, preset
from rollout.models.reference import hf_greedy
from test_engine_single import check_routed, prompts

from rollout.net import auth_headers

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

DP_RANKS = (0, 1)


@pytest.fixture
def engine_c(engine_pool, tiny_match_model):
    return engine_pool.get("c", preset("c", tiny_match_model))


def test_c_shape_and_plugin(engine_c):
    import requests

    info = requests.get(engine_c.url + "/server_info", headers=auth_headers(engine_c.api_key), timeout=60).json()
    assert info["tp_size"] == 4 and info["enable_dp_attention"] and info["ep_size"] == 4
    assert info["moe_dense_tp_size"] == 1 and info["enable_dp_lm_head"] and info["speculative_num_draft_tokens"] == 3
    fixes = set(active_fixes(engine_c))
    assert {"cpu-gloo-stacked-allgather", "cpu-ep-native-moe", "verify-padding-lcm"} <= fixes


@pytest.mark.parametrize("dp_rank", DP_RANKS)
def test_c_every_dp_rank_matches_transformers(engine_c, tiny_match_model, dp_rank):
    for ids in prompts(tiny_match_model):
        out = generate(engine_c, ids, 9, routed_dp_rank=dp_rank)
        assert out["meta_info"].get("dp_rank") == dp_rank
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
        assert out["meta_info"]["spec_accept_length"] >= 2.5
        check_routed(tiny_match_model, ids, out)


def test_c_concurrent_requests_on_both_ranks(engine_c, tiny_match_model):
    from concurrent.futures import ThreadPoolExecutor

    ids = prompts(tiny_match_model)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: generate(engine_c, ids[i % 2], 6, routed_dp_rank=i // 2), range(4)))
    for i, out in enumerate(outs):
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids[i % 2], 6)
        check_routed(tiny_match_model, ids[i % 2], out)


def mixed_load(engine, model):
    """6 concurrent requests: uneven prompt lengths and output lengths, both DP ranks, so
    prefill meets verify across ranks and per-rank token counts vary (3 draft tokens vs attn_tp 2)."""
    from concurrent.futures import ThreadPoolExecutor

    base = prompts(model)
    jobs = [(base[0], 3, 0), (base[1], 9, 1), (base[0] * 3, 14, 0), (base[1][:2], 5, 1), (base[1] * 2, 7, 0),
            (base[0][:1], 11, 1)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        outs = list(ex.map(lambda j: generate(engine, j[0], j[1], routed_dp_rank=j[2]), jobs))
    for (ids, n, rank), out in zip(jobs, outs):
        assert out["meta_info"].get("dp_rank") == rank
        assert out["output_ids"] == hf_greedy(model, ids, n)
        check_routed(model, ids, out)


def test_c_mixed_load(engine_c, tiny_match_model):
    mixed_load(engine_c, tiny_match_model)


def test_c_without_dp_fixes_same_results(engine_pool, tiny_match_model):
    """The same checks with the DP-attention fixes disabled.

    Measured on CPU: nothing differs - outputs, accept lengths and routed experts
    match transformers on both DP ranks with or without the fixes. The defects they fix live in
    code paths an eager CPU engine does not take (graph replays, flashinfer's row-count check,
    capture buffers shorter than a graph bucket). With CPU graph replay on, tests/test_cpu_graphs.py
    reaches capturer-extent and routed-experts-rows. This guard says the eager default is unaffected.
    """
    from sglang_patches.registry import all_fixes, detect, judge
    from sglang_patches.states import FixState

    here = detect()  # the fixes that hook this release (ports are data: per variant, not per fix)
    dp_fixes = [f.name for f in all_fixes() if f.family == "dp-attention" and judge(f, here).state is FixState.ACTIVE]
    assert dp_fixes, "no DP-attention fix hooks this SGLang: nothing to disable"
    eng = engine_pool.get("c-no-dp-fixes", preset("c", tiny_match_model,
                                                  env={"SLIME_MOE_ROLLOUT_DISABLE": ",".join(dp_fixes)}))
    assert not set(dp_fixes) & set(active_fixes(eng))
    for rank in DP_RANKS:
        for ids in prompts(tiny_match_model):
            out = generate(eng, ids, 9, routed_dp_rank=rank)
            assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
            check_routed(tiny_match_model, ids, out)
    mixed_load(eng, tiny_match_model)
