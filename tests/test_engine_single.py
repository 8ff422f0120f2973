"""Real SGLang on CPU, single rank: configurations (a) and (b) against transformers.

(a) routed experts on the random tiny model; (b) + NEXTN on the always-match model. Each test
asks the session engine pool for its configuration; the pool keeps one engine alive.
"""
import requests

import pytest
from support.engines import active_fixes, decode_routed, generate, log_text, preset
from rollout.models.reference import hf_greedy, hf_router_topk

from rollout.cli.engine import parse_startup_timings
from rollout.engines.process import alive_pids, rss
from rollout.net import auth_headers
from rollout.models.tiny import NUM_LAYERS, TOP_K, expected_experts

pytestmark = pytest.mark.slow

CPU_FIXES = {"cpu-host-register", "cpu-cuda-synchronize", "cpu-eagle-attn-backend"}


def prompts(path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok("the quick brown fox").input_ids, tok("rollout routing replay records experts").input_ids]


def check_routed(path, ids, out, seed=0):
    """routed_experts == transformers' router top-k for every token and MoE layer."""
    out_ids = out["output_ids"]
    seq = list(ids) + out_ids[:-1]  # SGLang reports P+O-1 rows: the last token is never forwarded
    routed = decode_routed(out["meta_info"]["routed_experts"], NUM_LAYERS, TOP_K)
    assert routed.shape == (len(seq), NUM_LAYERS, TOP_K)
    assert (routed[:, 0, :] == 0).all(), "dense layer 0 must report zeros"
    hf = hf_router_topk(path, seq)
    for layer in range(1, NUM_LAYERS):
        got = [sorted(r) for r in routed[:, layer, :].tolist()]
        assert got == hf[layer], f"layer {layer}: SGLang routed experts differ from transformers' router"
        assert got == expected_experts(seq, layer, seed), f"layer {layer}: not the experts the model was built with"


@pytest.fixture
def engine_a(engine_pool, tiny_model):
    return engine_pool.get("a", preset("a", tiny_model))


@pytest.fixture
def engine_b(engine_pool, tiny_match_model):
    return engine_pool.get("b", preset("b", tiny_match_model))


def test_a_plugin_loaded_and_api_key_enforced(engine_a):
    fixes = active_fixes(engine_a)
    assert fixes is not None, "plugin log line missing from the server log"
    assert CPU_FIXES <= set(fixes)
    assert engine_a.spec.host == "127.0.0.1"
    r = requests.post(engine_a.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                      timeout=60)
    assert r.status_code == 401
    info = requests.get(engine_a.url + "/server_info", headers=auth_headers(engine_a.api_key), timeout=60).json()
    assert info["enable_return_routed_experts"] is True and info["device"] == "cpu"
    assert info["attention_backend"] == "torch_native"  # no speculative decoding: SGLang's own CPU choice


def test_a_routed_experts_match_transformers(engine_a, tiny_model):
    for ids in prompts(tiny_model):
        check_routed(tiny_model, ids, generate(engine_a, ids, 6))


def test_a_startup_timings_and_memory(engine_a):
    t = parse_startup_timings(log_text(engine_a))
    assert t is not None and t["tokenizer_e2e"] > 0 and t["scheduler_e2e"] > 0
    mem = rss(engine_a.tree_pids())
    names = {n for n, _ in mem.values()}
    assert {"launch_server", "sglang::scheduler", "sglang::detokenizer"} <= names
    assert all(rss > 0 for _, rss in mem.values())


@pytest.mark.e2e
def test_b_greedy_equals_transformers_and_drafts_accepted(engine_b, tiny_match_model):
    assert "cpu-eagle-attn-backend" in active_fixes(engine_b)
    info = requests.get(engine_b.url + "/server_info", headers=auth_headers(engine_b.api_key), timeout=60).json()
    assert info["attention_backend"] == "intel_amx"  # kept on this AMX-less CPU for NEXTN
    for ids in prompts(tiny_match_model):
        out = generate(engine_b, ids, 12)
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 12)
        meta = out["meta_info"]
        # 2 draft steps: every verify accepts both drafts plus the bonus token when drafts always match.
        assert meta["spec_accept_length"] >= 2.5, meta
        check_routed(tiny_match_model, ids, out)


def test_b_concurrent_requests(engine_b, tiny_match_model):
    from concurrent.futures import ThreadPoolExecutor

    ids = prompts(tiny_match_model)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: generate(engine_b, ids[i % 2], 6), range(4)))
    want = [hf_greedy(tiny_match_model, ids[i % 2], 6) for i in range(2)]
    assert [o["output_ids"] for o in outs] == [want[0], want[1], want[0], want[1]]


def test_stop_leaves_no_orphans(engine_pool, engine_b):
    pids = engine_b.tree_pids()
    assert len(pids) >= 3
    engine_pool.close()
    assert alive_pids(pids) == []
