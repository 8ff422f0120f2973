"""Configuration (c) (tp 4, dp 2 DP attention, ep 4, dense-TP 1, DP lm-head, NEXTN, routed experts) as a real
CPU engine on the releases slime and Miles run: 0.5.19 (Miles) in eager mode, and with CPU graph replay on
0.5.15.post1, 0.5.15.post1 + slime's patches and 0.5.19: what `capturer-extent` and `routed-experts-rows`
change in a running engine. Each engine runs in its variant's environment (tests/version_engine.py);
transformers' router is asked here.
"""
import pytest
from conftest import hf_greedy
from test_cpu_graphs import DP_RANKS, wrong_rows
from version_engine import run

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CPU_C_FIXES = {"cpu-host-register", "cpu-eagle-attn-backend", "cpu-ep-native-moe", "cpu-gloo-scatter-gather",
               "cpu-gloo-stacked-allgather"}


def check_rows_match(model, got, n=9):
    """Every answer: its DP rank, transformers' greedy tokens, and transformers' router on every row."""
    ranks = set()
    for ids, rank, out in got["results"]:
        assert not isinstance(out, str), out
        if rank is not None:
            assert out["meta_info"]["dp_rank"] == rank
            ranks.add(rank)
        assert out["output_ids"] == hf_greedy(model, ids, n)
        assert wrong_rows(model, ids, out) == [], f"DP rank {rank}"
    assert ranks == set(DP_RANKS)


@pytest.mark.timeout(1200)
def test_c_routed_experts_match_transformers(tiny_match_model):
    """0.5.19, eager: every request pinned to each DP rank (alone, then all at once) gives transformers'
    tokens, and routed experts equal transformers' router on every token and rank."""
    got = run("0.5.19", model=tiny_match_model, preset="c", jobs="per_rank")
    assert CPU_C_FIXES | {"cpu-thread-binding", "capturer-extent", "verify-padding-lcm"} <= set(got["fixes"])
    check_rows_match(tiny_match_model, got)
    for _, _, out in got["results"]:
        assert out["meta_info"]["spec_accept_length"] >= 2.5
