"""Guard: prefill-graph buckets that attn_tp_size does not divide, under DP attention (sglang#36262, #33200).

Under DP attention with attn_tp > 1, a prefill graph's DP gather (`_dp_gather_via_all_gather`, MAX_LEN
mode in a graph) reduce-scatters the rank's bucket rows over the attention-TP group, which needs the
bucket to be a multiple of attn_tp_size ("input tensor must be the same size as output size times
world size" on NCCL). 0.5.22 and 0.5.23 make breakable prefill graphs the CUDA default and no longer
turn them off for DP attention, and their default buckets start 4, 8, ..., 32 (4, 12, 20, 28 are not
multiples of the seed's attn_tp 8). But their `PrefillCudaGraphRunner` captures
`get_prefill_num_tokens_to_capture(bs)`: every bucket ceil-aligned to `attn_tp_size` whenever the
gathered buffer is required (which is when the DP gather runs). So SGLang's own runner never captures
an unaligned bucket there: a guard, no port.

Real CPU engine, preset c (tp 4 / dp 2: attn_tp 2, ep 4, moe-dense-tp 1, dp-lm-head, routed experts)
with CPU graph replay and prefill buckets [7, 16]:
- as shipped: the runner captures 16 and 8 (never 7), the DP gather is in the graph, and prompts on both
  DP ranks replay the prefill graph with tokens and routed experts equal to transformers
  (`capturer-extent` and `routed-experts-rows` right on that path);
- with SGLang's alignment taken out (a test-only `sitecustomize` in the engine's processes makes
  `get_prefill_num_tokens_to_capture` plain `sorted`, as 0.5.21 and older have it): capturing 7 stops
  at the collective (gloo's check "outputShape[0] * worldSize == inputShape[0] (8 vs. 7)": 7 rows split 4 + 3 over 2 ranks).
"""
import os
import re
import textwrap

import pytest

from test_cpu_graphs import both_ranks_at_once, prefill_replayed_on, preset_c, with_graphs, wrong_rows

ODD_BUCKETS = {"backend": "full", "bs": [7, 16]}
CAPTURED = re.compile(r"Capturing prefill shape \(num_tokens=(\d+) ")
UNALIGNED = textwrap.dedent('''\
    """Test-only (tests/test_prefill_graph_attn_tp.py): SGLang's prefill runner without its bucket alignment."""
    import importlib.abc, sys

    NAME = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"

    class _Unaligned(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != NAME:
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.get_prefill_num_tokens_to_capture = sorted

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Unaligned())
    ''')


def _captured(log: str) -> set:
    return {int(n) for n in CAPTURED.findall(log)}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_odd_prefill_buckets_are_aligned_by_sglang_and_replay_right(engine_pool, tiny_match_model):
    from rollout.models.reference import hf_greedy
    from support.engines import log_text

    eng = engine_pool.get("c-prefill-graphs-odd", with_graphs(preset_c(tiny_match_model), prefill=ODD_BUCKETS))
    log = log_text(eng)
    assert "Capture target prefill CUDA graph begin. backend=full, num_tokens=[7, 16]" in log
    assert _captured(log) == {8, 16}, "SGLang's runner captures the buckets ceil-aligned to attn_tp_size 2"
    assert "Prefill CUDA graph captured a DP gather/scatter" in log
    outs = both_ranks_at_once(eng, tiny_match_model)
    assert prefill_replayed_on(eng) == {0, 1}, "no DP prefill replay"
    for ids, rank, out in outs:
        assert not isinstance(out, str), out
        assert out["meta_info"]["dp_rank"] == rank
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
        assert wrong_rows(tiny_match_model, ids, out) == [], f"DP rank {rank}"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_without_sglangs_alignment_the_odd_bucket_stops_at_the_collective(tmp_path, tiny_match_model):
    from test_cpu_graphs import failed_start_log

    site = tmp_path / "unaligned"
    site.mkdir()
    (site / "sitecustomize.py").write_text(UNALIGNED)
    spec = with_graphs(preset_c(tiny_match_model), prefill=ODD_BUCKETS)
    spec.group.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    log = failed_start_log(spec, str(tmp_path / "logs"), "Check failed")
    assert "Capturing prefill shape (num_tokens=7 " in log, "the unaligned bucket was not captured"
    assert re.search(r"Check failed: outputShape\[0\] \* worldSize == inputShape\[0\] \((8|6) vs\. 7\)", log), log[-3000:]


# ---- 0.5.23's default prefill graph type: breakable ----------------------------------------------------------
# SGLang's default backend and buckets: `max_bs` 32 makes SGLang's own bucket list 4, 8, ..., 32
# (generate_prefill_cuda_graph_batch_sizes), all multiples of attn_tp 2.
BREAKABLE = {"backend": "breakable", "max_bs": 32}
BREAKABLE_CAPTURE = "Capture target prefill CUDA graph begin. backend=breakable, num_tokens=[4, 8, 12, 16, 20, 24, 28, 32]"


def two_per_rank_at_once(engine, model, n=9, rounds=4) -> list:
    """[(ids, rank, out or error text)]: rounds of one batch request per DP rank (both prompts, pinned to
    that rank), the two sent at once, until a prefill graph replayed two requests on a rank (breakable
    replays take live multi-request batches; the full backend's one request slot sends them eager). A
    batch request reaches the scheduler as two requests back to back, so they prefill in one step."""
    from concurrent.futures import ThreadPoolExecutor

    from support.engines import generate
    from test_engine_single import prompts

    texts = prompts(model)

    def one(rank):
        try:
            return generate(engine, texts, n, routed_dp_rank=rank)
        except Exception as e:   # noqa: BLE001 - a crashed engine answers with a dropped connection
            return f"{type(e).__name__}: {e}"

    outs = []
    for _ in range(rounds):
        with ThreadPoolExecutor(2) as ex:
            answers = list(ex.map(one, (0, 1)))
        for rank, got in zip((0, 1), answers):
            outs += [(texts[0], rank, got)] if isinstance(got, str) else list(zip(texts, (rank, rank), got))
        if any(isinstance(out, str) for _, _, out in outs) or multi_request_replays(engine):
            break
    return outs


MULTI_REPLAY = re.compile(r" DP(\d) .*Prefill batch, #new-seq: ([2-9]|\d\d+), .*cpu graph: True")


def multi_request_replays(engine) -> set:
    """DP ranks whose log shows a prefill graph replay of two or more requests."""
    from support.engines import log_text

    return {int(m.group(1)) for m in MULTI_REPLAY.finditer(log_text(engine))}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_breakable_prefill_graphs_under_dp_attention_match_transformers(engine_pool, tiny_match_model):
    """0.5.23's default prefill path on configuration (c): SGLang's breakable runner data flow (the CPU
    stand-in subclasses BreakableCudaGraphBackend) with SGLang's default buckets; one request per rank,
    then two per rank in one replay. Tokens and routed experts equal transformers on both ranks."""
    from rollout.models.reference import hf_greedy
    from support.engines import log_text

    eng = engine_pool.get("c-prefill-graphs-breakable", with_graphs(preset_c(tiny_match_model), prefill=BREAKABLE))
    log = log_text(eng)
    assert BREAKABLE_CAPTURE in log, log[-3000:]
    assert "Prefill CUDA graph captured a DP gather/scatter" in log
    outs = both_ranks_at_once(eng, tiny_match_model) + two_per_rank_at_once(eng, tiny_match_model)
    assert prefill_replayed_on(eng) == {0, 1}, "no DP prefill replay"
    assert multi_request_replays(eng), "no prefill replay of two requests on a rank"
    for ids, rank, out in outs:
        assert not isinstance(out, str), out
        assert out["meta_info"]["dp_rank"] == rank
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
        assert wrong_rows(tiny_match_model, ids, out) == [], f"DP rank {rank}"
