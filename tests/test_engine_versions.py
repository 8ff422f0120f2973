"""Configuration (c) (tp 4, dp 2 DP attention, ep 4, dense-TP 1, DP lm-head, NEXTN, routed experts) as a real
CPU engine on the releases slime and Miles run. On 0.5.19 (Miles) it runs eagerly and with CPU graph replay,
which shows what `capturer-extent` and `routed-experts-rows` change in a running engine. On 0.5.15.post1
(slime's, with or without slime's patches) it cannot start on CPU: the NEXTN KV pool warms up a Triton
kernel that has no CPU path there. Each engine runs in its variant's environment (tests/version_engine.py);
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


# ---- CPU graph replay (SLIME_MOE_ROLLOUT_CPU_GRAPHS=1): the capturer extent and the capture buffer ----

GRAPH_VARIANTS = ("0.5.19",)
PREFILL_CRASH = "TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'"
PREFILL_CRASH_LINE = "local_start_pos = dp_rank * cuda_graph_batch"


def graphs_run(variant, model, jobs, disable=(), prefill=None, **group):
    got = run(variant, model=model, preset="c", jobs=jobs, disable=list(disable), group=group,
              graphs={"prefill": prefill})
    for name in disable:
        assert name not in got["fixes"]
    assert {"cpu-graphs-decode-runner", "cpu-graphs-replay-backend"} <= set(got["fixes"])
    return got


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS)
def test_c_graphs_with_the_fix_set_match_transformers(variant, tiny_match_model):
    """Verify through DecodeCudaGraphRunner replays on both DP ranks: tokens and routed experts equal
    transformers on every rank and token."""
    from test_cpu_graphs import ranks_replaying

    got = graphs_run(variant, tiny_match_model, "per_rank")
    assert "capturer-extent" in got["fixes"]
    assert ranks_replaying(got["log"]) == set(DP_RANKS)
    check_rows_match(tiny_match_model, got)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS)
def test_c_graphs_without_capturer_extent(variant, tiny_match_model):
    """`capturer-extent` off: the verify replay hands the capturer the decode runner's request count, so
    DP rank 1 reads its routed experts at stride `bs` instead of `bs * 3` draft tokens: tokens stay right,
    every row a verify replay wrote on rank 1 (rows 14-21 of 22) holds another row's experts, rank 0 is
    right."""
    from test_cpu_graphs import ranks_replaying

    got = graphs_run(variant, tiny_match_model, "per_rank", disable=("capturer-extent",))
    assert ranks_replaying(got["log"]) == set(DP_RANKS)
    for ids, rank, out in got["results"]:
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
        bad = wrong_rows(tiny_match_model, ids, out)
        if rank == 0:
            assert bad == [], f"DP rank {rank}"
        else:
            assert bad == list(range(len(ids), len(ids) + 8)), "every verify-written row on rank 1 is wrong"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS)
def test_c_prefill_graphs_without_capturer_extent_crash(variant, tiny_match_model):
    """`capturer-extent` off, prefill graphs on, a prompt on both DP ranks at once: the prefill replay leaves
    the capturer's graph batch size None and every scheduler dies in `get_dp_local_slice_cpu`."""
    from test_cpu_graphs import PREFILL_GRAPH

    got = graphs_run(variant, tiny_match_model, "rank_pairs", disable=("capturer-extent",), prefill=PREFILL_GRAPH)
    assert PREFILL_CRASH_LINE in got["log"] and PREFILL_CRASH in got["log"]
    assert all(isinstance(out, str) for _, _, out in got["results"]), "a request was answered by a crashed engine"
    assert not got["alive"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS)
def test_c_prefill_graphs_with_the_fix_set_match_transformers(variant, tiny_match_model):
    """The same engine and requests with the fix set: prefill replays on both DP ranks; tokens and routed
    experts equal transformers on every rank and token."""
    from test_cpu_graphs import PREFILL_GRAPH

    got = graphs_run(variant, tiny_match_model, "rank_pairs", prefill=PREFILL_GRAPH)
    replays = [x for x in got["log"].splitlines() if "Prefill batch" in x and "cpu graph: True" in x]
    assert {r for r in DP_RANKS if any(f" DP{r} " in x for x in replays)} == set(DP_RANKS), "no DP prefill replay"
    check_rows_match(tiny_match_model, got)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS)
def test_c_graphs_without_routed_experts_rows_crash_at_capture(variant, tiny_match_model):
    """`routed-experts-rows` off with a short capture buffer (max(chunked prefill, running requests) x DP
    ranks = 16 rows, ignoring the 3 verify tokens a request): capturing the bs-4 verify graph gathers
    4 x 3 x 2 = 24 rows into it and the engine never comes up."""
    from test_cpu_graphs import BUFFER_ROWS, ROWS_OVERFLOW, SHORT_BUFFER

    got = run(variant, model=tiny_match_model, preset="c", group=SHORT_BUFFER, graphs={},
              disable=["routed-experts-rows"], fail_text=ROWS_OVERFLOW)
    assert set(BUFFER_ROWS.findall(got["log"])) == {"16"}
    assert "Capture cuda graph failed: " + ROWS_OVERFLOW in got["log"]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", GRAPH_VARIANTS)
def test_c_graphs_short_buffer_with_the_fix_set_match_transformers(variant, tiny_match_model):
    """The same settings with the fix set: the buffer grows past SGLang's 16 rows to at least 4 x 3 x 2 = 24,
    and tokens and routed experts equal transformers on both ranks."""
    from test_cpu_graphs import BUFFER_ROWS, SHORT_BUFFER

    got = graphs_run(variant, tiny_match_model, "per_rank", **SHORT_BUFFER)
    assert "routed-experts-rows" in got["fixes"]
    rows = [int(n) for n in BUFFER_ROWS.findall(got["log"])]
    assert 16 in rows and max(rows) >= 24, rows
    check_rows_match(tiny_match_model, got)


KV_COPY_WARMUP = "_init_kv_copy_and_warmup"
NO_TRITON_DRIVER = "RuntimeError: 0 active drivers ([]). There should only be one."


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ("0.5.15.post1", "0.5.15.post1+slime"))
def test_c_cannot_start_on_0_5_15(variant, tiny_match_model):
    """0.5.15.post1 (slime's release, with or without slime's patches): configuration (c) dies at start-up on
    CPU, eager or with graphs, before any fix matters: with speculative decoding the KV pool warms up its
    Triton KV-copy kernel (memory_pool.py `_init_kv_copy_and_warmup`), which has no CPU path there
    (0.5.19 calls the CPU kernel op)."""
    got = run(variant, model=tiny_match_model, preset="c", fail_text=NO_TRITON_DRIVER)
    assert f"in {KV_COPY_WARMUP}" in got["log"] and NO_TRITON_DRIVER in got["log"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ("0.5.15.post1", "0.5.15.post1+slime"))
def test_a_decode_graphs_on_0_5_15(variant, tiny_model):
    """Where 0.5.15.post1 can run on CPU, configuration (a) (one rank, torch_native, routed experts): its
    graph ports keep the decode graph config torch_native turns off, build SGLang's DecodeCudaGraphRunner
    after `init_decode_cuda_graph` left none, and replay it eagerly; routed experts equal transformers."""
    from test_engine_single import check_routed

    from sglang_patches.cpu.graphs.backend import FIRST_REPLAY

    got = run(variant, model=tiny_model, preset="a", graphs={}, n=6)
    assert {"cpu-graphs-config", "cpu-graphs-decode-runner", "cpu-graphs-replay-backend"} <= set(got["fixes"])
    assert "CPU graph replay: DecodeCudaGraphRunner captured bs=[1, 2, 4]" in got["log"]
    assert f"{FIRST_REPLAY} DecodeCudaGraphRunner" in got["log"]
    for ids, _, out in got["results"]:
        check_routed(tiny_model, ids, out)
