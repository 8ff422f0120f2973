"""Scenarios that exercise real SGLang 0.5.23 code on the paths our DP-attention fixes change.

Run as a script in a fresh process, in one of three states:
    python tests/dp_scenarios.py plugin    # SGLang's own load_plugins() loads our entry point
    python tests/dp_scenarios.py none      # SGLANG_PLUGINS=none: stock SGLang
    python tests/dp_scenarios.py source    # no plugin; SGLang imported from PYTHONPATH (patched tree)
It prints one JSON object {scenario: {"ok": bool, "detail": str}}: "ok" means SGLang behaved
correctly. Hooks are process-global, hence one process per state.

Only the distributed context is simulated (which DP slot this process is, attn_tp size, the
schedule numbers); every function under test is SGLang's own.
"""
import sys
import traceback
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

from scenario_runner import main, registry

SCENARIOS, scenario = registry()


# ---------------------------------------------------------------- capturer extent (seed 004)

def _dp_context(stack, *, dp_rank, dp_size):
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.state_capturer.routed_experts as re_mod

    stack.enter_context(mock.patch.object(dpa, "dp_gather_width", lambda: dp_size))
    stack.enter_context(mock.patch.object(dpa, "dp_gather_slot", lambda: dp_rank))
    stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))
    stack.enter_context(mock.patch.object(re_mod, "_is_scattered_a2a_backend", lambda: False))


def _capturer(rows, layers=1, topk=2):
    """A RoutedExpertsCapturer with SGLang's device cache and a plain host buffer."""
    import torch
    from sglang.srt.state_capturer.base import BaseDeviceCache
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    cap = object.__new__(RoutedExpertsCapturer)
    cap.num_layers, cap.topk_size, cap.num_fused_shared_experts = layers, topk, 0
    cap.device_cache = BaseDeviceCache(rows, layers, topk, "cpu", name="routed_experts")
    cap.host_cache = SimpleNamespace(buffer=torch.full((256, layers, topk), -1, dtype=torch.int32))
    # DP-gathered capture: row i of the gathered batch holds ids (i, i) in every layer.
    ids = torch.arange(rows, dtype=torch.int32)[:, None, None].expand(rows, layers, topk)
    cap.device_cache.buffer.copy_(ids)
    return cap


def _registry_fill(fb, *, padded_bs, padded_num_tokens):
    """What a graph runner's load_batch does with this batch: SGLang's registry fill."""
    import torch
    from sglang.srt.model_executor.cuda_graph_buffer_registry import CudaGraphBufferRegistry

    reg = CudaGraphBufferRegistry(device=torch.device("cpu"), max_bs=64, max_num_tokens=256)
    reg.fill_from(fb, raw_bs=padded_bs, padded_bs=padded_bs, raw_num_tokens=padded_num_tokens,
                  padded_num_tokens=padded_num_tokens)


class _Recorder:
    """Stands in for the expert-distribution recorder: no recording."""

    def with_forward_pass(self, *a, **kw):
        from contextlib import nullcontext

        return nullcontext({})


def _model_runner_forward(fb, *, cap, graph_extent, can_run_graph, decode_bs):
    """SGLang's ModelRunner.forward on a runner whose _forward_raw is a graph replay (or eager)
    that fills the batch through SGLang's buffer registry, as load_batch does."""
    import sglang.srt.model_executor.model_runner as mr

    def forward_raw(forward_batch, *a, **kw):
        if graph_extent is not None:
            _registry_fill(forward_batch, padded_bs=graph_extent, padded_num_tokens=graph_extent)
        return mr.ModelRunnerOutput(logits_output=None, can_run_graph=can_run_graph)

    runner_cls = type("RunnerShell", (mr.ModelRunner,), {"__init__": lambda self: None})
    runner = runner_cls()
    runner.forward_pass_id, runner.msprobe_debugger, runner.canary_manager = 0, None, None
    runner.is_draft_worker, runner.enable_elastic_ep, runner.eplb_manager = False, False, None
    runner.decode_cuda_graph_runner = SimpleNamespace(bs=decode_bs) if decode_bs else SimpleNamespace()
    runner._forward_raw = forward_raw
    with ExitStack() as stack:
        for name, value in {
            "get_global_expert_distribution_recorder": lambda: _Recorder(),
            "get_global_experts_capturer": lambda: cap,
            "get_global_indexer_capturer": lambda: None,
            "get_schedule": lambda: SimpleNamespace(disable_overlap_schedule=True),
            "get_exec": lambda: SimpleNamespace(moe=SimpleNamespace(elastic_ep_backend=None)),
            "build_step_span_name": lambda *a, **kw: "step",
        }.items():
            stack.enter_context(mock.patch.object(mr, name, value))
        mr.ModelRunner.forward(runner, fb)


def _capture_rows(*, dp_rank, dp_size, global_num_tokens, graph_extent, decode_bs, can_run_graph=True):
    """One forward on this DP rank; return the gathered rows routed-expert capture stored."""
    import torch

    local = global_num_tokens[dp_rank]
    fb = SimpleNamespace(
        global_num_tokens_cpu=list(global_num_tokens),
        out_cache_loc=torch.arange(100, 100 + local),
        out_cache_loc_virtual=None,
        apply_deprecated_skip_attn_backend_init=lambda value: None,
        forward_mode=None,
    )
    with ExitStack() as stack:
        _dp_context(stack, dp_rank=dp_rank, dp_size=dp_size)
        cap = _capturer(rows=dp_size * max(graph_extent or 0, sum(global_num_tokens)) + 8)
        _model_runner_forward(fb, cap=cap, graph_extent=graph_extent, can_run_graph=can_run_graph,
                              decode_bs=decode_bs)
    return cap.host_cache.buffer[100 : 100 + local, 0, 0].tolist()


def _expect(got, want):
    return {"ok": got == want, "detail": f"stored gathered rows {got}, want {want}"}


@scenario
def capturer_extent_verify_graph():
    # EAGLE verify on the decode graph, k=4: rank 0 has 1 request, rank 1 has 2; graph bs 2.
    # The gathered stride is bs*k = 8 tokens; stock SGLang passes the decode runner's bs (2).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[4, 8], graph_extent=8, decode_bs=2)
    return _expect(got, list(range(8, 16)))


@scenario
def capturer_extent_prefill_graph_first():
    # Prefill-graph replay before any decode replay: the decode runner has no `bs` yet (None).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=None)
    return _expect(got, list(range(16, 32)))


@scenario
def capturer_extent_prefill_graph_stale_bs():
    # Prefill-graph replay after decode replays: the decode runner's `bs` is stale (4).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=4)
    return _expect(got, list(range(16, 32)))


@scenario
def capturer_extent_eager_prefix_sum():
    # Eager forward (guard): prefix-sum layout, whatever the decode runner last held.
    got = _capture_rows(dp_rank=2, dp_size=3, global_num_tokens=[4, 6, 5], graph_extent=None,
                        decode_bs=7, can_run_graph=False)
    return _expect(got, list(range(10, 15)))


# ---------------------------------------------------------------- routed-experts buffer rows

def _build_capturer(*, cps, mrr, num_dp, attn_tp, k=None, prefill_bs=None, context_len=4096):
    """SGLang's RoutedExpertsCapturer.__init__ under a simulated schedule / parallel context."""
    import torch
    import sglang.srt.runtime_context as rc
    import sglang.srt.state_capturer.base as base
    import sglang.srt.state_capturer.routed_experts as re_mod
    from sglang.srt.model_executor.cuda_graph_config import Backend

    def host_alloc(shape, dtype, device, pin_memory, allocator):
        return torch.empty(shape, dtype=dtype, device=device)

    graph = SimpleNamespace(cuda_graph_config=SimpleNamespace(
        prefill=SimpleNamespace(backend=Backend.FULL if prefill_bs else Backend.DISABLED, bs=prefill_bs),
        decode=SimpleNamespace(backend=Backend.DISABLED, bs=None),
    ))
    with ExitStack() as stack:
        stack.enter_context(mock.patch.dict(base.ALLOC_MEMORY_FUNCS, {"cpu": host_alloc}))
        stack.enter_context(mock.patch.object(re_mod, "get_schedule", lambda: SimpleNamespace(
            chunked_prefill_size=cps, max_prefill_tokens=16384)))
        stack.enter_context(mock.patch.object(re_mod, "get_parallel", lambda: SimpleNamespace(
            num_dp_ranks=num_dp, attn_tp_size=attn_tp)))
        stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))
        stack.enter_context(mock.patch.object(re_mod, "_is_scattered_a2a_backend", lambda: False))
        stack.enter_context(mock.patch.object(rc, "max_speculative_num_draft_tokens", lambda: k))
        stack.enter_context(mock.patch.object(rc, "get_exec", lambda: SimpleNamespace(graph=graph)))
        model_config = SimpleNamespace(
            context_len=context_len,
            hf_text_config=SimpleNamespace(num_experts_per_tok=8, num_hidden_layers=2))
        return re_mod.RoutedExpertsCapturer(model_config, num_tokens=64, max_running_requests=mrr,
                                            num_fused_shared_experts=0, device="cpu")


def _capture_ok(cap, rows):
    import torch

    try:
        cap.capture(0, torch.zeros(rows, 8, dtype=torch.int32))
    except RuntimeError as e:
        return {"ok": False, "detail": f"{rows} rows into {cap.device_cache.buffer.shape[0]}: {e}"}
    return {"ok": True, "detail": f"{rows} rows fit in {cap.device_cache.buffer.shape[0]}"}


@scenario
def routed_experts_rows_verify():
    # EAGLE verify, k=4, every rank full: num_dp * mrr * k gathered rows.
    cap = _build_capturer(cps=1024, mrr=1024, num_dp=4, attn_tp=8, k=4)
    return _capture_ok(cap, 4 * 1024 * 4)


@scenario
def routed_experts_rows_prefill_graph():
    # A prefill-graph bucket (2048) above the per-rank chunked prefill size (1024).
    cap = _build_capturer(cps=1024, mrr=256, num_dp=4, attn_tp=8, prefill_bs=[512, 1024, 2048])
    return _capture_ok(cap, 4 * 2048)


@scenario
def routed_experts_rows_unchunked():
    # chunked_prefill_size = -1: one long prompt per rank.
    cap = _build_capturer(cps=-1, mrr=256, num_dp=2, attn_tp=2, context_len=4096)
    return _capture_ok(cap, 2 * 4096)


@scenario
def routed_experts_rows_default():
    # Guard: a plain configuration keeps fitting.
    cap = _build_capturer(cps=2048, mrr=256, num_dp=4, attn_tp=8)
    return _capture_ok(cap, 4 * 2048)


# ---------------------------------------------------------------- eager draft extend (seed 000 fix 2)

class PlannedBackend:
    """An attention backend that checks its query rows against its plan, as flashinfer does."""

    def __init__(self):
        self.seen = []

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        import torch

        self.seen.append(q.shape[0])
        if q.shape[0] != forward_batch.forward_metadata_planned_num_tokens:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] "
                             f"({forward_batch.forward_metadata_planned_num_tokens})")
        return torch.ones(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def _draft_extend_batch(real, padded, planned):
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(
        forward_mode=ForwardMode.DRAFT_EXTEND_V2,
        global_num_token_non_padded_cpu=real,
        global_num_tokens_padded_cpu=[padded],
        forward_metadata_planned_num_tokens=planned,
        out_cache_loc=torch.arange(padded),
        positions=torch.arange(padded),
        mha_return_lse=False,
        _attn_output=None,
        moe_num_token_non_padded=lambda: None,
    )


@scenario
def draft_extend_real_rows():
    # bs=1, k=4 padded to attn_tp 8; plan covers the 4 real rows. RadixAttention must hand the
    # backend 4 query rows (flashinfer checks q.shape[0] == qo_indptr[-1]) and zero-pad the rest.
    import torch
    import sglang.srt.layers.radix_attention as ra

    fb = _draft_extend_batch(real=4, padded=8, planned=4)
    layer = ra.RadixAttention(num_heads=2, head_dim=4, scaling=1.0, num_kv_heads=2, layer_id=0)
    q, k, v = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend = PlannedBackend()
    seen = backend.seen
    try:
        with mock.patch.object(ra, "get_attn_backend", lambda: backend), \
                forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            out = layer.forward(q, k, v, fb)
    except ValueError as e:
        return {"ok": False, "detail": str(e)}
    out = out.reshape(8, -1)
    ok = seen == [4] and bool((out[4:] == 0).all()) and bool((out[:4] == 1).all())
    return {"ok": ok, "detail": f"backend saw {seen} rows; output rows {tuple(out.shape)}"}


@scenario
def draft_extend_unpadded_untouched():
    # Guard: no MLP-sync padding, or a plan that already covers the padded rows -> no trimming.
    import torch
    from sglang.srt.layers.attention import graph_utils

    q = torch.empty(8, 2, 4)
    a = graph_utils.padded_extend_real_tokens(q, _draft_extend_batch(real=4, padded=8, planned=8))
    fb = _draft_extend_batch(real=4, padded=8, planned=4)
    fb.global_num_tokens_padded_cpu = None
    b = graph_utils.padded_extend_real_tokens(q, fb)
    return {"ok": a is None and b is None, "detail": f"replanned -> {a}, unpadded -> {b}"}


# ---------------------------------------------------------------- verify padding (lcm)

def _verify_batch(bs, k, mode="TARGET_VERIFY", gathered=None):
    """A speculative batch of `bs` requests, `k` tokens each (`mode` IDLE: bs 0, the same spec width)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = bs * k
    gathered = gathered or [n]
    return ForwardBatch(
        forward_mode=ForwardMode[mode],
        batch_size=bs,
        input_ids=torch.arange(n),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.full((bs,), 10),
        out_cache_loc=torch.arange(n),
        seq_lens_sum=10 * bs,
        seq_lens_cpu=torch.full((bs,), 10),
        positions=torch.arange(n),
        global_num_tokens_cpu=list(gathered),
        global_num_tokens_for_logprob_cpu=list(gathered),
        global_num_tokens_gpu=torch.zeros(len(gathered), dtype=torch.int64),
        global_num_tokens_for_logprob_gpu=torch.zeros(len(gathered), dtype=torch.int64),
        spec_info=SimpleNamespace(num_tokens_per_req=k, is_draft_input=lambda: False),
    )


def _prepare(bs, k, attn_tp, mode="TARGET_VERIFY", gathered=None, slot=0, server_k=None):
    """Stock `prepare_mlp_sync_batch` on DP slot `slot` of a gather of `gathered` per-rank counts."""
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.model_executor.forward_batch_info as fbi
    import sglang.srt.runtime_context as rc

    fb = _verify_batch(bs, k, mode, gathered)
    width = len(fb.global_num_tokens_cpu)
    runner = SimpleNamespace(
        attn_tp_sequence_sharded=lambda n: True,
        model_config=SimpleNamespace(hf_config=SimpleNamespace()),
        is_draft_worker=False,
        attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: 1,
                                     get_cpu_graph_seq_len_fill_value=lambda: 1),
        server_args=SimpleNamespace(),
    )
    parallel = SimpleNamespace(attn_tp_size=attn_tp, attn_dp_size=2, num_dp_ranks=2)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(fbi, "get_parallel", lambda: parallel))
        stack.enter_context(mock.patch.object(rc, "get_parallel", lambda: parallel))
        stack.enter_context(mock.patch.object(dpa, "dp_gather_width", lambda: width))
        stack.enter_context(mock.patch.object(dpa, "dp_gather_slot", lambda: slot))
        stack.enter_context(mock.patch.object(fbi, "_is_cpu", True))  # no pinned memory here
        stack.enter_context(mock.patch.object(fbi, "get_exec", lambda: SimpleNamespace(graph=SimpleNamespace(
            cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(bs=None))))))
        stack.enter_context(mock.patch.object(rc, "max_speculative_num_draft_tokens", lambda: server_k or k))
        stack.enter_context(mock.patch.object(fbi, "set_dp_buffer_len_from_batch", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "set_is_extend_in_batch", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "mambaish_config", lambda *a, **kw: None))
        try:
            fb.prepare_mlp_sync_batch(runner)
        except Exception as e:  # noqa: BLE001 - report whatever stock SGLang raises
            return fb, f"{type(e).__name__}: {e} " + traceback.format_exc(limit=-2).replace("\n", " | ")
    return fb, None


def _verify_rows(bs, k, attn_tp):
    fb, err = _prepare(bs, k, attn_tp)
    rows = fb.input_ids.shape[0]
    if err:
        return {"ok": False, "detail": err}
    return {"ok": rows == fb.batch_size * k,
            "detail": f"{rows} padded rows, batch_size {fb.batch_size} x k {k} = {fb.batch_size * k}"}


@scenario
def verify_padding_k3_attn_tp8():
    return _verify_rows(bs=1, k=3, attn_tp=8)


@scenario
def verify_padding_k6_attn_tp4():
    return _verify_rows(bs=3, k=6, attn_tp=4)


@scenario
def verify_padding_k4_attn_tp8():
    # Guard: k divides attn_tp (the seed's EAGLE 3/1/4 setting) pads to whole requests already.
    return _verify_rows(bs=1, k=4, attn_tp=8)


# Two DP ranks in one step, attn_tp 2, k = 3 draft tokens (configuration (c)): a busy rank (verify: 3
# tokens a request; draft decode: 1) and an idle rank whose spec input has the same phase's width.
# Both must pad the gathered list alike, verify to whole requests, draft decode (4 requests) to no
# more than its 4 requests (the eager registry holds ceil_align(4, attn_tp) = 4 rows).

def _ranks_padded(mode, width, bs):
    g = [bs * width, 0]
    (busy, e1), (idle, e2) = (_prepare(bs, width, 2, mode, gathered=g, slot=0, server_k=3),
                              _prepare(0, width, 2, "IDLE", gathered=g, slot=1, server_k=3))
    if e1 or e2:
        return {"ok": False, "detail": e1 or e2}
    lists = [busy.global_num_tokens_padded_cpu, idle.global_num_tokens_padded_cpu]
    rows = busy.input_ids.shape[0]
    whole = rows == busy.batch_size * width and (width > 1 or busy.batch_size == bs)
    return {"ok": lists[0] == lists[1] and whole,
            "detail": f"padded lists {lists[0]} / {lists[1]} (busy / idle rank); busy rank {rows} rows, "
                      f"batch_size {busy.batch_size} x {width}"}


@scenario
def verify_padding_ranks_agree_verify():
    return _ranks_padded("TARGET_VERIFY", 3, bs=1)


@scenario
def verify_padding_ranks_agree_draft_decode():
    # Guard: draft decode (1 token a request) needs attn_tp alignment only: 4 requests stay 4 rows.
    return _ranks_padded("DECODE", 1, bs=4)


# ---------------------------------------------------------------- capture snapshot (sglang#34319)

SNAPSHOT_STOCK = "host rows of slots 10..14 [900, 101, 102, 103, 900]"  # 0.5.15.post1 / 0.5.16 without the fix

def _overlap_forward(cap, locs, first_id):
    """One forward under overlap scheduling: capture, SGLang's deferred output, the scheduler's D2H."""
    import torch
    import sglang.srt.state_capturer.routed_experts as re_mod
    from sglang.srt.managers.utils import GenerationBatchResult

    ids = torch.arange(first_id, first_id + len(locs), dtype=torch.int32)[:, None].expand(len(locs), cap.topk_size)
    for layer in range(cap.num_layers):
        cap.capture(layer, ids.contiguous())
    fb = SimpleNamespace(out_cache_loc=torch.tensor(locs), out_cache_loc_virtual=None)
    with mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: False):
        out = cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True)
    result = GenerationBatchResult(next_token_ids=torch.zeros(1, dtype=torch.int64), routed_experts_output=out,
                                   copy_done=SimpleNamespace(record=lambda: None))
    result.copy_to_cpu(return_logprob=False, return_hidden_states=False)
    return result


@scenario
def capture_snapshot_overlap():
    # Prefill of 4 tokens (KV slots 10..13, experts 100..103), then the next decode forward (slot 14,
    # expert 900) runs before the prefill's result is processed: the overlap scheduler's order.
    cap = _capturer(rows=16)
    prefill = _overlap_forward(cap, [10, 11, 12, 13], 100)
    decode = _overlap_forward(cap, [14], 900)
    prefill.routed_experts_output.finalize()
    decode.routed_experts_output.finalize()
    got = cap.host_cache.buffer[10:15, 0, 0].tolist()
    want = [100, 101, 102, 103, 900]
    return {"ok": got == want, "detail": f"host rows of slots 10..14 {got}, want {want}"}


if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
