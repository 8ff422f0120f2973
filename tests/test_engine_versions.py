"""Configuration (c) (tp 4, dp 2 DP attention, ep 4, dense-TP 1, DP lm-head, NEXTN, routed experts) as a real
CPU engine on the releases slime and Miles run. On 0.5.19 (Miles) it runs eagerly and with CPU graph replay,
which shows what `capturer-extent` and `routed-experts-rows` change in a running engine. On 0.5.15.post1
(slime's, with or without slime's patches) it cannot start on CPU: the NEXTN KV pool warms up a Triton
kernel that has no CPU path there; without NEXTN and with CPU prefill graphs it runs, and shows the two
fixes' prefill-graph results (the `test_c_no_nextn_*` tests). Each engine runs in its variant's
environment (tests/version_engine.py); transformers' router is asked here.
"""
import re

import pytest
from rollout.models.reference import hf_greedy
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
    last_round = [out for _, _, out in got["results"][-len(DP_RANKS):]]   # earlier rounds ran eager and finished
    assert all(isinstance(out, str) for out in last_round), "a request was answered by a crashed engine"
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
    (0.5.19 calls the CPU kernel op). Without NEXTN it starts with CPU graphs on (`test_c_no_nextn_*`)."""
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


# ---- 0.5.15.post1 (stock and slime's image): configuration (c) without NEXTN, CPU prefill graphs on ----

V0515 = ("0.5.15.post1", "0.5.15.post1+slime")
NO_NEXTN = {"speculative": None}   # NEXTN cannot start there (test_c_cannot_start_on_0_5_15)
PREFILL_REPLAY = re.compile(r" DP(\d) .*Prefill batch, #new-seq: 1, #new-token: (\d+),.* cpu graph: True")


def prefill_replay_ranks(log: str, min_tokens: int = 14) -> set:
    """DP ranks whose log shows a prefill-graph replay of at least `min_tokens` prompt tokens (a whole
    14-token prompt by default; readiness's probes replay 1-token prompts)."""
    return {int(rank) for rank, n in PREFILL_REPLAY.findall(log) if int(n) >= min_tokens}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", V0515)
def test_c_no_nextn_prefill_graphs_without_capturer_extent_crash(variant, tiny_match_model):
    """`capturer-extent` off: readiness's DP probe (a 1-token prompt on each DP rank at once) is the first
    forward, a prefill-graph replay before any decode replay, so the capturer is handed the decode runner's
    `bs`, still None (stock passes `bs`; slime's patch passes `bs * num_tokens_per_bs` once `bs` is set, else
    None), and every scheduler dies in `get_dp_local_slice_cpu`: the engine never comes up. slime's patch
    fixes the verify stride, not this prefill half."""
    from sglang_patches.cpu.graphs.backend import FIRST_REPLAY
    from test_cpu_graphs import PREFILL_GRAPH

    got = run(variant, model=tiny_match_model, preset="c", group=NO_NEXTN, graphs={"prefill": PREFILL_GRAPH},
              disable=["capturer-extent"], not_ready=True)
    log = got["log"]
    assert "phase '/health_generate 200' failed" in got["not_ready"]
    assert PREFILL_CRASH_LINE in log and PREFILL_CRASH in log
    replay = log.index(f"{FIRST_REPLAY} PrefillCudaGraphRunner")
    assert replay < log.index(PREFILL_CRASH) and f"{FIRST_REPLAY} DecodeCudaGraphRunner" not in log
    assert "cpu-graphs-dp-memcpy" in log and "capturer-extent" not in log.split("active fixes:")[1].splitlines()[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", V0515)
def test_c_no_nextn_prefill_graphs_match_transformers(variant, tiny_match_model):
    """The same engine and requests with the fix set (on slime's image: slime's patch plus the plugin):
    whole prompts replay the prefill graph on both DP ranks; tokens and routed experts equal transformers
    on every rank and token."""
    from test_cpu_graphs import PREFILL_GRAPH

    got = graphs_run(variant, tiny_match_model, "rank_pairs", prefill=PREFILL_GRAPH, **NO_NEXTN)
    assert {"capturer-extent", "cpu-graphs-dp-memcpy", "cpu-graphs-mlp-sync-pin"} <= set(got["fixes"])
    assert prefill_replay_ranks(got["log"]) == set(DP_RANKS), "no whole-prompt prefill replay on a rank"
    check_rows_match(tiny_match_model, got)


PINNED = "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend"


@pytest.mark.timeout(900)
def test_c_no_nextn_without_mlp_sync_pin_dies_at_first_forward(tiny_match_model):
    """0.5.15.post1, `cpu-graphs-mlp-sync-pin` off: the graphs are captured, then the first eager DP-attention
    forward (readiness's probes) stages the DP token counts in pinned memory and every scheduler dies."""
    from test_cpu_graphs import PREFILL_GRAPH

    got = run("0.5.15.post1", model=tiny_match_model, preset="c", group=NO_NEXTN, graphs={"prefill": PREFILL_GRAPH},
              disable=["cpu-graphs-mlp-sync-pin"], not_ready=True)
    log = got["log"]
    assert "CPU graph replay: DecodeCudaGraphRunner captured bs=" in log
    assert PINNED in log and "in prepare_mlp_sync_batch" in log


SHORT_PREFILL_BUFFER = {**NO_NEXTN, "chunked_prefill_size": 16, "max_running_requests": 12}
PREFILL_ROWS_OVERFLOW = "The expanded size of the tensor (16) must match the existing size (64)"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", V0515)
def test_c_no_nextn_prefill_graphs_without_routed_experts_rows_crash_at_capture(variant, tiny_match_model):
    """`routed-experts-rows` off, chunked prefill 16 and 12 running requests: SGLang sizes the capture buffer
    max(8, 6) x 2 DP ranks = 16 rows, below the prefill graph buckets; capturing the 32-token prefill graph
    gathers 32 x 2 = 64 rows into it and the engine never comes up."""
    from test_cpu_graphs import BUFFER_ROWS, PREFILL_GRAPH

    got = run(variant, model=tiny_match_model, preset="c", group=SHORT_PREFILL_BUFFER,
              graphs={"prefill": PREFILL_GRAPH}, disable=["routed-experts-rows"], fail_text=PREFILL_ROWS_OVERFLOW)
    assert set(BUFFER_ROWS.findall(got["log"])) == {"16"}
    assert PREFILL_ROWS_OVERFLOW in got["log"] and "in capture_one_shape" in got["log"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", V0515)
def test_c_no_nextn_prefill_graphs_short_buffer_match_transformers(variant, tiny_match_model):
    """The same settings with the fix set: the buffer grows past SGLang's 16 rows to the 32-token bucket
    x 2 DP ranks = 64; each prompt prefills in chunks of 8 and 6 tokens a rank (SGLang halves chunked prefill
    per DP rank), replayed on the 16-token graph on both ranks; tokens and routed experts equal transformers
    on both ranks."""
    from test_cpu_graphs import BUFFER_ROWS, PREFILL_GRAPH

    got = graphs_run(variant, tiny_match_model, "rank_pairs", prefill=PREFILL_GRAPH, **SHORT_PREFILL_BUFFER)
    assert "routed-experts-rows" in got["fixes"]
    rows = [int(n) for n in BUFFER_ROWS.findall(got["log"])]
    assert 16 in rows and max(rows) >= 64, rows
    assert prefill_replay_ranks(got["log"], min_tokens=8) == set(DP_RANKS), "no 8-token chunk replayed on a rank"
    check_rows_match(tiny_match_model, got)
