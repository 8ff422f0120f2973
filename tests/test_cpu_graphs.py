"""CPU graph replay (`sglang_patches/cpu/graphs`): SGLang's own graph runners on a CPU engine.

Fast checks: the backend's capture/replay contract, and each hooked SGLang function called in a
probe subprocess with and without the plugin (stock SGLang shows the CPU gap, the plugin closes
it). Slow checks start real engines with `SLIME_MOE_ROLLOUT_CPU_GRAPHS=1` and compare with the
same engine in eager mode (tokens, logprobs, routed experts) and with transformers.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from sglang_patches.cpu.graphs import ENV, FIXES
from sglang_patches.cpu.graphs.backend import copy_into, make_backend
from sglang_patches.registry import judge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r'''
import json, sys, types
from sglang.srt.plugins import load_plugins
load_plugins()
results = {}

def check(name):
    def deco(fn):
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return fn
    return deco

@check("graph-config")
def _():
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.arg_groups.overrides import resolved_view
    sa = prepare_server_args(["--model-path", sys.argv[1], "--device", "cpu", "--attention-backend", "torch_native",
                              "--cuda-graph-config", '{"decode":{"backend":"full","bs":[1,2]},"prefill":{"backend":"full","bs":[16]}}'])
    sa.resolve_once()
    cfg = resolved_view(sa).cuda_graph_config
    return [cfg.decode.backend, cfg.prefill.backend]

@check("verify-dispatch")
def _():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    return [m.name for m in ForwardMode if m.is_cpu_graph()]

@check("attn-fill")
def _():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    b = TorchNativeAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None))
    b.init_cuda_graph_state(4, 4)
    return b.get_cuda_graph_seq_len_fill_value()

@check("pynccl-state")
def _():
    from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator
    comm = object.__new__(PyNcclCommunicator)
    comm.available, comm.disabled = False, True
    with comm.change_state(enable=True):
        return "disabled" if comm.disabled else "enabled"

print("PROBE-RESULTS " + json.dumps(results))
'''


def run_probe(model, **env_over) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", **{ENV: "1"})
    for k in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE"):
        env.pop(k, None)
    env.update(env_over)
    proc = subprocess.run([sys.executable, "-c", PROBE, model], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=400)
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULTS "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"probe failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def probes(tiny_match_model):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        stock = ex.submit(run_probe, tiny_match_model, SGLANG_PLUGINS="none")
        fixed = ex.submit(run_probe, tiny_match_model)
        return {"stock": stock.result(), "fixed": fixed.result()}


@pytest.mark.timeout(600)
def test_graph_config_kept(probes):
    assert probes["stock"]["graph-config"] == ["disabled", "disabled"]
    assert probes["fixed"]["graph-config"] == ["full", "full"]


@pytest.mark.timeout(600)
def test_verify_and_idle_batches_reach_the_graph_runner(probes):
    assert probes["stock"]["verify-dispatch"] == ["DECODE"]
    assert set(probes["fixed"]["verify-dispatch"]) >= {"DECODE", "TARGET_VERIFY", "IDLE"}


@pytest.mark.timeout(600)
def test_cpu_attention_backends_get_graph_hooks(probes):
    assert probes["stock"]["attn-fill"].startswith("NotImplementedError")
    assert probes["fixed"]["attn-fill"] == 1


@pytest.mark.timeout(600)
def test_unavailable_pynccl_stays_off_in_capture(probes):
    assert probes["stock"]["pynccl-state"] == "enabled"
    assert probes["fixed"]["pynccl-state"] == "disabled"


def test_graph_fixes_idle_unless_asked(monkeypatch):
    """Each graph fix hooked on 0.5.23 (the others are upstream there: guard tests) is idle unless asked for."""
    from sglang_patches.registry import table

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_DISABLE", raising=False)
    monkeypatch.delenv(ENV, raising=False)
    hooked = [f for f in FIXES if table("v0_5_23")[f.name].state == "active"]
    assert {f.name for f in FIXES} - {f.name for f in hooked} == {"cpu-graphs-dp-memcpy", "cpu-graphs-mlp-sync-pin"}
    for fix in hooked:
        v = judge(fix, "0.5.23")
        assert v.state == "idle" and ENV in v.reason, fix.name
    monkeypatch.setenv(ENV, "1")
    for fix in hooked:
        assert fix.family == "cpu" and judge(fix, "0.5.23").state == "active", fix.name
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    assert all(judge(f, "0.5.23").state == "idle" for f in hooked)


def test_eager_replay_reruns_on_static_buffers(monkeypatch):
    """capture: 2 warm-ups + 1 recorded run; replay: the recorded callable again, its result
    copied into the captured output (fixed tensors, as a graph's)."""
    import types

    import torch
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    barriers = []
    monkeypatch.setattr("sglang.srt.runtime_context.get_parallel",
                        lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(barrier=lambda: barriers.append(1))))
    static_in = torch.zeros(4)
    calls = []

    def forward():
        calls.append(1)
        return (static_in * 2, {"h": static_in + 1})

    backend = make_backend(types.SimpleNamespace())
    assert isinstance(backend, FullCudaGraphBackend)
    backend.capture_one("bs4", forward)
    assert len(calls) == 3 and len(barriers) == 2 and backend.can_run(None, "bs4") and not backend.can_run(None, "bs2")
    captured = backend._outputs["bs4"]
    static_in.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    out = backend.replay("bs4", None)
    assert out is captured and out[0].tolist() == [2, 4, 6, 8] and out[1]["h"].tolist() == [2, 3, 4, 5]


def test_replay_undoes_the_prefill_forward_redirect(monkeypatch):
    """The prefill runner points layer_model.forward at a function calling replay()."""
    import types

    import torch

    monkeypatch.setattr("sglang.srt.runtime_context.get_parallel",
                        lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(barrier=lambda: None)))

    class Layers:
        def forward(self):
            return torch.ones(2)

    runner = types.SimpleNamespace(layer_model=Layers())
    backend = make_backend(runner)
    backend.capture_one("t16", lambda: runner.layer_model.forward())
    runner.layer_model.forward = lambda: backend.replay("t16", None)
    assert runner.layer_model.forward().tolist() == [1, 1]  # no recursion
    assert "forward" in runner.layer_model.__dict__  # the runner's redirect is back for its own restore


@pytest.mark.timeout(120)
def test_breakable_replay_runs_breaks_on_the_live_batch(monkeypatch):
    """The breakable stand-in is a `BreakableCudaGraphBackend` (the prefill runner's breakable data flow)
    and runs under SGLang's breakable flag; on replay the code between `eager_on_graph` breaks reads the
    capture batch (what a graph baked) and each break reads the batch current at replay, as on CUDA.
    Uses SGLang's real decorator: if its wrapper stops bracketing the body with `_end_current_segment` /
    `_begin_new_segment`, the break reads the capture batch and this fails."""
    import types

    import torch
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (eager_on_graph,
                                                                                       is_in_breakable_cuda_graph)
    from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch, set_forward_batch

    monkeypatch.setattr("sglang.srt.runtime_context.get_parallel",
                        lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(barrier=lambda: None)))
    capture_batch, live_batch = types.SimpleNamespace(n=100), types.SimpleNamespace(n=1)
    flags = []

    @eager_on_graph
    def attention(x):
        flags.append(is_in_breakable_cuda_graph())
        return x + get_forward_batch().n

    def forward():   # as the runner's _run_forward: enters its capture batch
        with set_forward_batch(capture_batch):
            return attention(torch.zeros(2) + get_forward_batch().n) * 10

    backend = make_backend(types.SimpleNamespace(), breakable=True)
    assert isinstance(backend, BreakableCudaGraphBackend)
    with backend.capture_session(None):
        backend.capture_one("t16", forward)
    assert backend._outputs["t16"].tolist() == [2000, 2000] and flags == [True] * 3
    with backend.replay_session(), set_forward_batch(live_batch):
        out = backend.replay("t16", None)
    assert out.tolist() == [1010, 1010], "segment: capture batch (100), break: live batch (1)"
    assert flags == [True] * 4, "SGLang's breakable flag is on during capture and re-run"


def test_copy_into_rejects_a_changed_shape():
    import torch

    with pytest.raises(RuntimeError, match=r"eager replay: output\[0\] is \(3,\), captured \(4,\)"):
        copy_into((torch.zeros(4),), (torch.zeros(3),))


def test_cuda_only_custom_op_gets_a_cpu_kernel():
    """Up to 0.5.19 prefill attention goes through an SGLang custom op registered for CUDA only: on CPU tensors
    the dispatcher refuses it; after cpu_kernels_for_cuda_only_ops the op's own Python function runs."""
    import torch

    from sglang_patches.cpu.graphs.backend import cpu_kernels_for_cuda_only_ops

    lib = torch.library.Library("slime_moe_rollout_test", "FRAGMENT")
    lib.define("add_one(Tensor(a!) x) -> ()")
    def add_one(x):
        x.add_(1)

    lib.impl("add_one", add_one, "CUDA")
    x = torch.zeros(2)
    with pytest.raises(NotImplementedError, match="with arguments from the 'CPU' backend"):
        torch.ops.slime_moe_rollout_test.add_one(x)
    assert cpu_kernels_for_cuda_only_ops(["add_one", "absent"], namespace="slime_moe_rollout_test") == ["add_one"]
    torch.ops.slime_moe_rollout_test.add_one(x)
    assert x.tolist() == [1, 1]
    assert cpu_kernels_for_cuda_only_ops(["add_one"], namespace="slime_moe_rollout_test") == []  # once


MEMCPY_PROBE = r"""
import json, sys, torch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers import dp_attention as d
copy = getattr(d, sys.argv[1])
out = {}
try:
    src, dst, g = torch.arange(12.).view(6, 2), torch.zeros(4, 2), torch.zeros(6, 2)
    copy(dst, src, 0, torch.tensor([2]), torch.tensor([3]), True)    # rows 2-4 of src to dst[0:3]
    copy(g, torch.ones(2, 2), 0, torch.tensor([3]), torch.tensor([2]), False)    # 2 rows to g[3:5]
    out["rows"] = [dst.tolist(), g.tolist()]
except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
print("MEMCPY " + json.dumps(out))
"""
MEMCPY_ROWS = [[[4, 5], [6, 7], [8, 9], [0, 0]], [[0, 0], [0, 0], [0, 0], [1, 1], [1, 1], [0, 0]]]


def memcpy_probe(python, fn, **env_over) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=ROOT, **{ENV: "1"})
    for k in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE"):
        env.pop(k, None)
    env.update(env_over)
    proc = subprocess.run([str(python), "-c", MEMCPY_PROBE, fn], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    line = [x for x in proc.stdout.splitlines() if x.startswith("MEMCPY ")]
    assert line, f"memcpy probe failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[0].split(" ", 1)[1])


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_dp_memcpy_on_0_5_15():
    """0.5.15.post1: DP attention's row copy is a Triton launch on CPU tensors too (no driver: dies);
    with the plugin (graphs on) the same call copies the kernel's rows with torch. 0.5.23 (guard): SGLang's
    own dispatcher picks its CPU copy on CPU and copies the same rows."""
    from support.variant_runs import python_of

    py = python_of("0.5.15.post1")
    stock = memcpy_probe(py, "memcpy_triton", SGLANG_PLUGINS="none")
    assert stock == {"error": "RuntimeError: 0 active drivers ([]). There should only be one."}
    assert memcpy_probe(py, "memcpy_triton") == {"rows": MEMCPY_ROWS}
    assert memcpy_probe(sys.executable, "memcpy", SGLANG_PLUGINS="none") == {"rows": MEMCPY_ROWS}


# ---- real engines ---------------------------------------------------------------------------

DECODE_BUCKETS = [1, 2, 4]
REPLAY_LINE = "Decode graph replay: worker=target key_size={key} (bs) mode={mode} raw_bs={raw}"


def with_graphs(spec, prefill=None, disable=()):
    """`spec` (an EngineSpec) with CPU graph replay on: decode buckets 1/2/4, prefill graphs as given."""
    cfg = {"decode": {"backend": "full", "bs": DECODE_BUCKETS}, "prefill": prefill or {"backend": "disabled"}}
    g = spec.group
    g.env.update({ENV: "1", "SGLANG_LOG_DECODE_GRAPH_KEY": "1"})
    if disable:
        g.env["SLIME_MOE_ROLLOUT_DISABLE"] = ",".join(disable)
    g.extra_sglang_args.update(cuda_graph_config=json.dumps(cfg), disable_cuda_graph=False)
    return spec


def greedy_runs(engine, prompts_, n, **extra):
    """One request alone, then three at once (a batch of 3 pads to the bs-4 graph)."""
    from concurrent.futures import ThreadPoolExecutor

    from support.engines import generate

    def one(i):
        out = generate(engine, prompts_[i % len(prompts_)], n, return_logprob=True, **extra)
        meta = out["meta_info"]
        return {"ids": out["output_ids"], "logprobs": [x[0] for x in meta["output_token_logprobs"]],
                "routed": meta.get("routed_experts"), "out": out}

    first = [one(0)]
    with ThreadPoolExecutor(3) as ex:
        return first + list(ex.map(one, range(1, 4)))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_decode_graph_one_rank_equals_eager(engine_pool, tiny_match_model):
    """DecodeCudaGraphRunner replayed on CPU gives what the eager engine gives, token for token."""
    from support.engines import log_text, preset
    from test_engine_single import check_routed, prompts

    ps = prompts(tiny_match_model)
    eager = greedy_runs(engine_pool.get("a-match", preset("a", tiny_match_model)), ps, 8)
    eng = engine_pool.get("a-graphs", with_graphs(preset("a", tiny_match_model)))
    graphs = greedy_runs(eng, ps, 8)
    log = log_text(eng)
    assert "CPU graph replay: DecodeCudaGraphRunner captured bs=[1, 2, 4]" in log
    assert REPLAY_LINE.format(key=4, mode="DECODE", raw=3) in log, "3 concurrent requests never replayed the bs-4 graph"
    for i, (e, g) in enumerate(zip(eager, graphs)):
        assert g["ids"] == e["ids"], f"request {i}: tokens differ from eager"
        assert g["logprobs"] == e["logprobs"], f"request {i}: logprobs differ from eager"
        assert g["routed"] == e["routed"], f"request {i}: routed experts differ from eager"
        check_routed(tiny_match_model, ps[i % len(ps)], g["out"])


PREFILL_GRAPH = {"backend": "full", "bs": [16, 32]}
PREFILL_REPLAYED = re.compile(r"Prefill batch, #new-seq: 1, #new-token: (\d+),.* cpu graph: True")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_prefill_graph_one_rank_equals_eager(engine_pool, tiny_match_model):
    """PrefillCudaGraphRunner replayed on CPU (each 14-token prompt padded to the 16-token graph) gives
    what the eager engine gives: tokens, and routed experts whose prompt rows the replay captured."""
    from support.engines import generate, log_text, preset
    from test_engine_single import check_routed, prompts

    ps = prompts(tiny_match_model)   # two prompts, no shared prefix: each prefill is a fresh 14 tokens

    def runs(engine):   # one at a time, no logprobs: the runner replays such batches (can_replay_locally)
        return [generate(engine, ids, 8) for ids in ps]

    eager = runs(engine_pool.get("a-match", preset("a", tiny_match_model)))
    eng = engine_pool.get("a-prefill-graphs", with_graphs(preset("a", tiny_match_model), prefill=PREFILL_GRAPH))
    graphs = runs(eng)
    replayed = [int(n) for n in PREFILL_REPLAYED.findall(log_text(eng))]
    assert any(9 <= n <= 16 for n in replayed), f"no prompt prefill replayed the 16-token graph: {replayed}"
    for i, (e, g) in enumerate(zip(eager, graphs)):
        assert g["output_ids"] == e["output_ids"], f"request {i}: tokens differ from eager"
        assert g["meta_info"]["routed_experts"] == e["meta_info"]["routed_experts"], f"request {i}: routed experts"
        check_routed(tiny_match_model, ps[i], g)


# ---- configuration (c) with graphs: what each DP-attention fix changes in a running engine ----

DP_RANKS = (0, 1)


def preset_c(model):
    from support.engines import preset

    return preset("c", model)


def c_graph_engine(engine_pool, model, key, disable=()):
    return engine_pool.get(key, with_graphs(preset_c(model), disable=disable))


def per_rank_results(engine, model, n=9, copies=1):
    """{rank: [(prompt, out)]}: each prompt pinned to each DP rank, alone, then all at once
    (`copies` times each, so a DP rank runs 2 x copies requests together)."""
    from concurrent.futures import ThreadPoolExecutor

    from support.engines import generate
    from test_engine_single import prompts

    jobs = [(ids, rank) for rank in DP_RANKS for ids in prompts(model) for _ in range(copies)]
    res = {rank: [] for rank in DP_RANKS}
    for ids, rank in jobs[:2]:
        res[rank].append((ids, generate(engine, ids, n, routed_dp_rank=rank)))
    with ThreadPoolExecutor(len(jobs)) as ex:
        outs = list(ex.map(lambda j: generate(engine, j[0], n, routed_dp_rank=j[1]), jobs))
    for (ids, rank), out in zip(jobs, outs):
        res[rank].append((ids, out))
    return res


def wrong_rows(model, ids, out) -> list:
    """Positions whose routed experts differ from transformers' router (any MoE layer)."""
    from support.engines import decode_routed
    from rollout.models.reference import hf_router_topk

    from rollout.models.tiny import NUM_LAYERS, TOP_K

    seq = list(ids) + out["output_ids"][:-1]  # SGLang reports P+O-1 rows
    routed = decode_routed(out["meta_info"]["routed_experts"], NUM_LAYERS, TOP_K)
    assert routed.shape[0] == len(seq)
    hf = hf_router_topk(model, seq)
    return [t for t in range(len(seq)) if any(sorted(routed[t, layer].tolist()) != hf[layer][t] for layer in hf)]


def ranks_replaying(log: str, mode: str = "TARGET_VERIFY") -> set:
    """DP ranks whose log shows a decode-graph replay in `mode` with at least one real request."""
    lines = [x for x in log.splitlines() if f"mode={mode} raw_bs=" in x and not x.endswith("raw_bs=0")]
    return {r for r in DP_RANKS if any(f" DP{r} " in x for x in lines)}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_c_graphs_with_the_fix_set_match_transformers(engine_pool, tiny_match_model):
    """Configuration (c), verify through DecodeCudaGraphRunner replays on both DP ranks: tokens and
    routed experts equal transformers on every rank and token."""
    from support.engines import log_text
    from rollout.models.reference import hf_greedy

    eng = c_graph_engine(engine_pool, tiny_match_model, "c-graphs")
    res = per_rank_results(eng, tiny_match_model)
    assert ranks_replaying(log_text(eng)) == set(DP_RANKS)
    for rank, outs in res.items():
        for ids, out in outs:
            assert out["meta_info"]["dp_rank"] == rank
            assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
            assert out["meta_info"]["spec_accept_length"] >= 2.5
            assert wrong_rows(tiny_match_model, ids, out) == [], f"DP rank {rank}"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_c_graphs_without_capturer_extent_corrupts_rank_1(engine_pool, tiny_match_model):
    """`capturer-extent` off: the verify replay hands the capturer the decode runner's request
    count, so DP rank 1 reads its routed experts at stride `bs` instead of `bs * 3` draft tokens.
    Tokens stay right; every generated row on rank 1 comes back with another row's experts
    (measured: rows 14-21 of 22, the prompt rows from eager prefill stay right); rank 0 is right."""
    from support.engines import active_fixes, log_text
    from rollout.models.reference import hf_greedy

    eng = c_graph_engine(engine_pool, tiny_match_model, "c-graphs-no-capturer-extent", disable=("capturer-extent",))
    assert "capturer-extent" not in active_fixes(eng)
    res = per_rank_results(eng, tiny_match_model)
    assert ranks_replaying(log_text(eng)) == set(DP_RANKS)
    for rank, outs in res.items():
        for ids, out in outs:
            assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
            bad = wrong_rows(tiny_match_model, ids, out)
            if rank == 0:
                assert bad == [], "DP rank 0 slices from offset 0: right without the fix"
            else:
                assert bad == list(range(len(ids), len(ids) + 8)), "every verify-written row on rank 1 is wrong"


def prefill_replayed_on(engine) -> set:
    """The DP ranks whose log shows a prefill batch that replayed a CPU graph."""
    from support.engines import log_text

    replays = [x for x in log_text(engine).splitlines() if "Prefill batch" in x and "cpu graph: True" in x]
    return {r for r in DP_RANKS if any(f" DP{r} " in x for x in replays)}


def both_ranks_at_once(engine, model, n=9, rounds=6, min_rounds=1) -> list:
    """[(ids, rank, out or error text)]: rounds of one prompt pinned to each DP rank, sent at once, until a
    prefill graph replayed on every DP rank or a request failed. Under DP attention a prefill graph replays
    only when every DP rank prefills in the same step, and it takes one request per rank: two requests that
    reach one rank together make a prefill of 2, which runs eager. One prompt per rank per round keeps each
    prefill at one request; a round whose two requests land in different steps is followed by another.
    At least `min_rounds` rounds run (the prompts in turn) unless a request failed."""
    from concurrent.futures import ThreadPoolExecutor

    from support.engines import generate
    from test_engine_single import prompts

    def one(job):
        try:
            return generate(engine, job[0], n, routed_dp_rank=job[1])
        except Exception as e:   # noqa: BLE001 - a crashed engine answers with a dropped connection
            return f"{type(e).__name__}: {e}"

    outs, texts = [], prompts(model)
    for i in range(rounds):
        jobs = [(texts[i % len(texts)], rank) for rank in DP_RANKS]
        with ThreadPoolExecutor(len(jobs)) as ex:
            outs += [(ids, rank, out) for (ids, rank), out in zip(jobs, ex.map(one, jobs))]
        if any(isinstance(out, str) for _, _, out in outs) or \
                i + 1 >= min_rounds and prefill_replayed_on(engine) == set(DP_RANKS):
            break
    return outs


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_c_prefill_graphs_without_capturer_extent_crash(engine_pool, tiny_match_model):
    """`capturer-extent` off, prefill graphs on under DP attention: the prefill replay leaves the
    capturer's graph batch size None and every scheduler dies in `get_dp_local_slice_cpu`
    (`dp_rank * cuda_graph_batch`) at the first prefill that both DP ranks run in one step."""
    from support.engines import active_fixes, exited, log_text

    eng = engine_pool.get("c-prefill-graphs-no-capturer-extent", with_graphs(
        preset_c(tiny_match_model), prefill=PREFILL_GRAPH, disable=("capturer-extent",)))
    assert "capturer-extent" not in active_fixes(eng)
    outs = both_ranks_at_once(eng, tiny_match_model)
    log = log_text(eng)
    assert "local_start_pos = dp_rank * cuda_graph_batch" in log
    assert "TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'" in log
    last_round = [out for _, _, out in outs[-len(DP_RANKS):]]   # earlier rounds prefilled eager and finished
    assert all(isinstance(out, str) for out in last_round), "a request was answered by a crashed engine"
    assert exited(eng), "the server outlived its crashed schedulers"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_c_prefill_graphs_with_the_fix_set_match_transformers(engine_pool, tiny_match_model):
    """The same engine and requests with the fix set: prefill replays on both DP ranks, tokens and
    routed experts equal transformers on every rank and token."""
    from rollout.models.reference import hf_greedy

    eng = engine_pool.get("c-prefill-graphs", with_graphs(preset_c(tiny_match_model), prefill=PREFILL_GRAPH))
    outs = both_ranks_at_once(eng, tiny_match_model)
    assert prefill_replayed_on(eng) == set(DP_RANKS), "no DP prefill replay"
    for ids, rank, out in outs:
        assert not isinstance(out, str), out
        assert out["meta_info"]["dp_rank"] == rank
        assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
        assert wrong_rows(tiny_match_model, ids, out) == [], f"DP rank {rank}"


# `routed-experts-rows`: chunked prefill 16 and 12 running requests (SGLang gives each DP rank half),
# so SGLang sizes the capture buffer max(8, 6) x 2 DP ranks = 16 rows while the bs-4 verify graph
# gathers 4 x 3 draft tokens x 2 ranks = 24. (6 running requests a rank, not 4: see the README.)
SHORT_BUFFER = {"chunked_prefill_size": 16, "max_running_requests": 12}
BUFFER_ROWS = re.compile(r"DeviceCache\[routed_experts\] allocated: shape=\((\d+), ")
ROWS_OVERFLOW = "The expanded size of the tensor (16) must match the existing size (24)"


def short_buffer_engine_spec(model, disable=()):
    from support.engines import preset

    return with_graphs(preset("c", model, **SHORT_BUFFER), disable=disable)


def failed_start_log(spec, log_dir, text) -> str:
    """Start an engine that must not come up; its whole log once `text` is in it or it exited."""
    import time

    from support.engines import ENGINE_BUDGET_S, log_text, stop_engine

    from rollout.engines.local_backend import LocalBackend

    eng = LocalBackend(log_dir).start(spec)
    try:
        end = time.monotonic() + ENGINE_BUDGET_S
        while eng.alive() and text not in log_text(eng):
            assert time.monotonic() < end, f"the engine neither exited nor logged {text!r} in {ENGINE_BUDGET_S:g} s"
            time.sleep(1)
        time.sleep(2)   # the rest of the traceback
        return log_text(eng)
    finally:
        assert not stop_engine(eng)[1], "processes left after stop"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_c_graphs_without_routed_experts_rows_crash_at_capture(tmp_path, tiny_match_model):
    """`routed-experts-rows` off, configuration (c) with a short capture buffer (max(chunked prefill,
    running requests) x DP ranks ignores the 3 verify tokens a request): capturing the bs-4 verify
    graph writes 24 gathered rows into SGLang's 16-row buffer and the engine never comes up."""
    from rollout.cli.engine import parse_active_fixes

    spec = short_buffer_engine_spec(tiny_match_model, disable=("routed-experts-rows",))
    log = failed_start_log(spec, str(tmp_path), ROWS_OVERFLOW)
    assert set(BUFFER_ROWS.findall(log)) == {"16"}
    assert "Capture cuda graph failed: " + ROWS_OVERFLOW in log
    assert "routed-experts-rows" not in parse_active_fixes(log)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_c_graphs_short_buffer_with_the_fix_set_match_transformers(engine_pool, tiny_match_model):
    """The same settings with the fix set: the buffer grows to at least 4 x 3 x 2 = 24 rows (after
    SGLang's 16), verify replays on both DP ranks, tokens and routed experts equal transformers."""
    from support.engines import active_fixes, log_text
    from rollout.models.reference import hf_greedy

    eng = engine_pool.get("c-graphs-short-buffer", short_buffer_engine_spec(tiny_match_model))
    assert "routed-experts-rows" in active_fixes(eng)
    res = per_rank_results(eng, tiny_match_model)
    log = log_text(eng)
    rows = [int(n) for n in BUFFER_ROWS.findall(log)]
    assert 16 in rows and max(rows) >= 24, rows
    assert ranks_replaying(log) == set(DP_RANKS)
    for rank, outs in res.items():
        for ids, out in outs:
            assert out["meta_info"]["dp_rank"] == rank
            assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
            assert wrong_rows(tiny_match_model, ids, out) == [], f"DP rank {rank}"


# `verify-padding-lcm`: 8 running requests (4 a DP rank) make the draft's eager buffer registry 4 rows,
# ceil_align(4, attn_tp 2). A hook that aligns every speculative batch to lcm(2, 3) = 6,
# draft decode (1 token a request) included; the test re-installs it in the engine's processes through
# a sitecustomize shim (test-only, nothing in the product reads it).
LCM_ARGS = {"chunked_prefill_size": 16, "max_running_requests": 8}
DRAFT_ROWS_OVERFLOW = "The size of tensor a (4) must match the size of tensor b (6)"
OLD_LCM_HOOK = """
from sglang_patches.fixes import verify_padding_lcm


def _server_wide_k(forward_batch):
    from sglang.srt.runtime_context import max_speculative_num_draft_tokens
    return max_speculative_num_draft_tokens()


verify_padding_lcm.request_width = _server_wide_k
"""


def lcm_engine_spec(model, shim_dir=None):
    from support.engines import preset

    spec = with_graphs(preset("c", model, **LCM_ARGS))
    if shim_dir:
        with open(os.path.join(shim_dir, "sitecustomize.py"), "w") as f:
            f.write(OLD_LCM_HOOK)
        spec.group.env["PYTHONPATH"] = os.pathsep.join(p for p in (shim_dir, os.environ.get("PYTHONPATH")) if p)
    return spec


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_c_old_verify_padding_lcm_pads_draft_decode_and_crashes(tmp_path, engine_pool, tiny_match_model):
    """A hook aligning every speculative batch to lcm(attn_tp 2, k 3) = 6: the first
    request's draft decode pads 1 token a request to 6 rows, more than the draft's 4-row eager registry,
    and every scheduler dies in `fill_from`."""
    import requests

    from support.engines import active_fixes, exited, generate, log_text
    from test_engine_single import prompts

    eng = engine_pool.get("c-graphs-old-lcm", lcm_engine_spec(tiny_match_model, shim_dir=str(tmp_path)))
    assert "verify-padding-lcm" in active_fixes(eng)
    with pytest.raises(requests.RequestException):   # the engine drops the connection
        generate(eng, prompts(tiny_match_model)[0], 9, routed_dp_rank=0)
    log = log_text(eng)
    assert "RuntimeError: " + DRAFT_ROWS_OVERFLOW in log
    assert "in _draft_forward_idle" in log and "in fill_from" in log
    assert exited(eng), "the server outlived its crashed schedulers"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_c_verify_padding_lcm_leaves_draft_decode_alone(engine_pool, tiny_match_model):
    """The same engine with the hook as shipped (only batches whose requests are k tokens wide are
    aligned to 6): 4 requests a DP rank at once, verify replays on both ranks, tokens and routed
    experts equal transformers on every rank and token."""
    from support.engines import active_fixes, log_text
    from rollout.models.reference import hf_greedy

    eng = engine_pool.get("c-graphs-lcm", lcm_engine_spec(tiny_match_model))
    assert "verify-padding-lcm" in active_fixes(eng)
    res = per_rank_results(eng, tiny_match_model, copies=2)
    log = log_text(eng)
    assert DRAFT_ROWS_OVERFLOW not in log
    assert ranks_replaying(log) == set(DP_RANKS)
    assert REPLAY_LINE.format(key=4, mode="TARGET_VERIFY", raw=4) in log, "no rank verified 4 requests at once"
    for rank, outs in res.items():
        for ids, out in outs:
            assert out["meta_info"]["dp_rank"] == rank
            assert out["output_ids"] == hf_greedy(tiny_match_model, ids, 9)
            assert wrong_rows(tiny_match_model, ids, out) == [], f"DP rank {rank}"
