"""The group-placement benchmark's SGLang stand-in answers the recorded sequence as SGLang 0.5.23 did
(tests/facts/sglang-0.5.23-prefix-cache.json, the DP-attention miniature with NEXTN): a prompt again on
its rank is cached but for the recorded tail, on the other rank not at all, and a zero-token request
primes the cache, and a longer prompt behind a cached one (the benchmark's shared system prefix) is
cached but for its last token; with no prefix length given it matches whole prompts only."""
import json
import multiprocessing as mp
import os
import sys

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import group_placement as bench  # noqa: E402

from rollout.net import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_standin_replays_the_recorded_prefix_cache_answers():
    with open(bench.FACT) as fh:
        rec = json.load(fh)["c"]["answers"]
    p = [3 + (7 * i) % 300 for i in range(256)]
    q = [3 + (11 * i + 5) % 300 for i in range(256)]
    inputs = [p, p, p, p + [5] * 16, q, q]
    port, ready = free_port(), mp.Event()
    srv = mp.Process(target=bench._serve, args=([port], 2, bench.recorded_tail(), len(p), 8, (0.002, 0.0, 0.0),
                                                ready, None), daemon=True)
    srv.start()
    try:
        assert ready.wait(30)
        got = []
        for ids, r in zip(inputs, rec):
            body = {"input_ids": ids, "routed_dp_rank": r["sent"]["routed_dp_rank"],
                    "sampling_params": {"max_new_tokens": r["sent"]["max_new_tokens"]}}
            meta = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=10).json()["meta_info"]
            got.append({k: meta[k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "dp_rank")})
    finally:
        srv.kill()
    want = [{k: r[k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "dp_rank")} for r in rec]
    assert want[3]["cached_tokens"] == 255        # the prefix case as recorded
    assert got == want


def test_arms_of_a_round_run_the_same_step_with_prompts_of_their_own():
    """The engines benchmark's arms are compared on one step: the same prompt lengths and budgets, other
    tokens (so no arm finds another's prompts cached)."""
    from group_placement_engines import PREFIX_LEN, rl_groups
    a, b = rl_groups(12, 8, 100, 8, tokens_seed=100), rl_groups(12, 8, 100, 8, tokens_seed=101)
    assert [(len(p), bs) for p, bs in a] == [(len(p), bs) for p, bs in b]
    assert all(pa[:PREFIX_LEN] == pb[:PREFIX_LEN] and pa[PREFIX_LEN:] != pb[PREFIX_LEN:] for (pa, _), (pb, _) in zip(a, b))
