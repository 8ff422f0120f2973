"""Scenarios on real SGLang 0.5.15.post1 code (stock wheel, and with slime's image patches), run like
`dp_scenarios.py` (plugin / none / source). The API differs from 0.5.23 (fix map "API differences"):
server args instead of the runtime context, get_attention_dp_rank instead of dp_gather_slot, no
dp_slot_in, no graph_utils.padded_extend_real_tokens. Only the distributed context is simulated.

EXPECT[variant]: "fixes" {fix: {scenario: needle the stock detail must contain}}, "guards"
[scenarios right with and without the plugin], "registered" (fixes the plugin hooks), "states"
(dp-attention fix states in `patches status`).
"""
import sys
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

from dp_scenarios import (SNAPSHOT_STOCK, PlannedBackend, _capture_ok, _capturer, _expect, _Recorder,
                          _registry_fill, capture_snapshot_overlap)
from guard_scenarios import health_generate_codes, ranks_agree_draft_decode, verify_logits_rows
from scenario_runner import main, registry

SCENARIOS, scenario = registry()
scenario(capture_snapshot_overlap)  # sglang#34319: the prefill's row 0 holds the next decode's experts
ROWS_MSG = "must match the existing size"
NONE_MUL = "unsupported operand type(s) for *: 'int' and 'NoneType'"


def _server_args(**kw):
    from sglang.srt.model_executor.cuda_graph_config import Backend

    prefill_bs, decode_bs = kw.pop("prefill_bs", None), kw.pop("decode_bs", None)
    graph = SimpleNamespace(
        prefill=SimpleNamespace(backend=Backend.FULL if prefill_bs else Backend.DISABLED, bs=prefill_bs),
        decode=SimpleNamespace(backend=Backend.FULL if decode_bs else Backend.DISABLED, bs=decode_bs))
    base = dict(chunked_prefill_size=2048, dp_size=4, enable_dp_attention=True, speculative_algorithm=None,
                speculative_num_draft_tokens=None, max_speculative_num_draft_tokens=None,
                cuda_graph_config=graph, disable_overlap_schedule=True, elastic_ep_backend=None)
    return SimpleNamespace(**{**base, **kw})


def _not_deepep():
    return SimpleNamespace(is_deepep=lambda: False, is_none=lambda: True)


# ---------------------------------------------------------------- capturer extent

def _model_runner_forward(fb, *, cap, graph_extent, can_run_graph, decode_bs, tokens_per_bs):
    import sglang.srt.model_executor.model_runner as mr

    def forward_raw(forward_batch, *a, **kw):
        if graph_extent is not None:  # the graph runner's replay_prepare fills through the registry
            _registry_fill(forward_batch, padded_bs=graph_extent, padded_num_tokens=graph_extent)
        return mr.ModelRunnerOutput(logits_output=None, can_run_graph=can_run_graph)

    runner = type("RunnerShell", (mr.ModelRunner,), {"__init__": lambda self: None})()
    runner.forward_pass_id, runner.msprobe_debugger, runner.canary_manager = 0, None, None
    runner.is_draft_worker, runner.enable_elastic_ep, runner.eplb_manager = False, False, None
    runner.server_args = _server_args()
    runner.decode_cuda_graph_runner = SimpleNamespace(bs=decode_bs, num_tokens_per_bs=tokens_per_bs)
    runner._forward_raw = forward_raw
    with ExitStack() as stack:
        for name, value in {
            "get_global_expert_distribution_recorder": lambda: _Recorder(),
            "get_global_experts_capturer": lambda: cap,
            "get_global_indexer_capturer": lambda: None,
            "_build_step_span_name": lambda *a, **kw: "step",
        }.items():
            stack.enter_context(mock.patch.object(mr, name, value))
        mr.ModelRunner.forward(runner, fb)


def _capture_rows(*, dp_rank, dp_size, global_num_tokens, graph_extent, decode_bs, tokens_per_bs=4,
                  can_run_graph=True):
    import torch
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.state_capturer.routed_experts as re_mod

    local = global_num_tokens[dp_rank]
    fb = SimpleNamespace(global_num_tokens_cpu=list(global_num_tokens), out_cache_loc=torch.arange(100, 100 + local),
                         out_cache_loc_virtual=None, apply_deprecated_skip_attn_backend_init=lambda v: None,
                         forward_mode=None)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(dpa, "get_attention_dp_rank", lambda: dp_rank))
        stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))
        stack.enter_context(mock.patch.object(re_mod, "get_moe_a2a_backend", _not_deepep))
        cap = _capturer(rows=dp_size * max(graph_extent or 0, sum(global_num_tokens)) + 8)
        _model_runner_forward(fb, cap=cap, graph_extent=graph_extent, can_run_graph=can_run_graph,
                              decode_bs=decode_bs, tokens_per_bs=tokens_per_bs)
    return cap.host_cache.buffer[100 : 100 + local, 0, 0].tolist()


@scenario
def capturer_extent_verify_graph():
    # EAGLE verify on the decode graph, k=4, graph bs 2: the gathered stride is 8 tokens per rank.
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[4, 8], graph_extent=8, decode_bs=2)
    return _expect(got, list(range(8, 16)))


@scenario
def capturer_extent_prefill_graph_first():
    # Prefill-graph replay (opt-in: --cuda-graph-backend-prefill) before any decode replay.
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=None)
    return _expect(got, list(range(16, 32)))


@scenario
def capturer_extent_prefill_graph_stale_bs():
    # Prefill-graph replay after decode replays (decode bs 2, 4 tokens per request: slime reads 8).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=2)
    return _expect(got, list(range(16, 32)))


@scenario
def capturer_extent_eager_prefix_sum():
    got = _capture_rows(dp_rank=2, dp_size=3, global_num_tokens=[4, 6, 5], graph_extent=None, decode_bs=7,
                        can_run_graph=False)
    return _expect(got, list(range(10, 15)))


# ---------------------------------------------------------------- routed-experts buffer rows

def _build_capturer(*, cps, mrr, num_dp, attn_tp, k=None, prefill_bs=None, context_len=4096):
    import torch
    import sglang.srt.state_capturer.base as base
    import sglang.srt.state_capturer.routed_experts as re_mod

    sa = _server_args(chunked_prefill_size=cps, dp_size=num_dp, prefill_bs=prefill_bs,
                      speculative_algorithm="EAGLE" if k else None, speculative_num_draft_tokens=k)
    host = lambda n, layers, topk, name: SimpleNamespace(buffer=torch.empty((n, layers, topk), dtype=torch.int32))  # noqa: E731
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(base, "BaseHostCache", host))  # pinned memory needs CUDA
        stack.enter_context(mock.patch.object(re_mod, "get_global_server_args", lambda: sa))
        stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))
        stack.enter_context(mock.patch.object(re_mod, "get_attention_tp_size", lambda: attn_tp))
        stack.enter_context(mock.patch.object(re_mod, "get_moe_a2a_backend", _not_deepep))
        model_config = SimpleNamespace(context_len=context_len,
                                       hf_text_config=SimpleNamespace(num_experts_per_tok=8, num_hidden_layers=2))
        cap = re_mod.RoutedExpertsCapturer(model_config, num_tokens=64, max_running_requests=mrr,
                                           num_fused_shared_experts=0, device="cpu")
        stack.enter_context(mock.patch.object(re_mod, "get_moe_a2a_backend", _not_deepep))
        return cap


def _fits(rows, **kw):
    import sglang.srt.state_capturer.routed_experts as re_mod

    cap = _build_capturer(**kw)
    with mock.patch.object(re_mod, "get_moe_a2a_backend", _not_deepep):
        return _capture_ok(cap, rows)


@scenario
def routed_experts_rows_verify():
    # EAGLE verify, k=4, every rank full: num_dp * mrr * k gathered rows.
    return _fits(4 * 1024 * 4, cps=1024, mrr=1024, num_dp=4, attn_tp=8, k=4)


@scenario
def routed_experts_rows_prefill_graph():
    # 0.5.15 sets the prefill-graph max bs to the undivided chunked_prefill_size (4x the per-rank chunk).
    return _fits(4 * 4096, cps=1024, mrr=256, num_dp=4, attn_tp=8, prefill_bs=[1024, 2048, 4096])


@scenario
def routed_experts_rows_default():
    return _fits(4 * 2048, cps=2048, mrr=256, num_dp=4, attn_tp=8)


# ---------------------------------------------------------------- eager draft extend

def _draft_extend(real, padded):
    import torch
    import sglang.srt.layers.radix_attention as ra
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = SimpleNamespace(forward_mode=ForwardMode.DRAFT_EXTEND_V2, forward_metadata_ready=True,
                         forward_metadata_planned_num_tokens=real, out_cache_loc=torch.arange(padded),
                         positions=torch.arange(padded))
    layer = ra.RadixAttention(num_heads=2, head_dim=4, scaling=1.0, num_kv_heads=2, layer_id=0)
    backend = PlannedBackend()
    q, k, v = torch.randn(padded, 8), torch.randn(padded, 8), torch.randn(padded, 8)
    try:
        with mock.patch.object(ra, "get_attn_backend", lambda: backend):
            out = layer.forward(q, k, v, fb)
    except ValueError as e:
        return {"ok": False, "detail": str(e)}
    out = out.reshape(padded, -1)
    ok = backend.seen == [real] and bool((out[real:] == 0).all()) and bool((out[:real] == 1).all())
    ok = ok and fb.out_cache_loc.shape[0] == padded  # the batch is left as it was
    return {"ok": ok, "detail": f"backend saw {backend.seen} rows; output rows {tuple(out.shape)}"}


@scenario
def draft_extend_real_rows():
    return _draft_extend(real=4, padded=8)  # bs 1, k 4 padded to attn_tp 8 after the plan


@scenario
def draft_extend_real_rows_k3():
    return _draft_extend(real=12, padded=16)


# ---------------------------------------------------------------- verify padding (lcm)

class _TorchWithoutPinnedMemory:
    """torch as forward_batch_info sees it, minus pin_memory (CPU-only torch has no pinned allocator)."""

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*a, pin_memory=False, **kw):
        import torch

        return torch.tensor(*a, **kw)


def _prepare(bs, k, attn_tp, mode="TARGET_VERIFY", gathered=None, dp_rank=0, server_k=None):
    """Stock `prepare_mlp_sync_batch` on DP rank `dp_rank` of a gather of `gathered` per-rank counts."""
    import torch
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.layers.utils.cp_utils as cp
    import sglang.srt.model_executor.forward_batch_info as fbi
    import sglang.srt.server_args as sa_mod
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = bs * k
    gathered = gathered or [n]
    fb = ForwardBatch(
        forward_mode=ForwardMode[mode], batch_size=bs, input_ids=torch.arange(n),
        req_pool_indices=torch.arange(bs), seq_lens=torch.full((bs,), 10), out_cache_loc=torch.arange(n),
        seq_lens_sum=10 * bs, seq_lens_cpu=torch.full((bs,), 10), positions=torch.arange(n),
        global_num_tokens_cpu=list(gathered), global_num_tokens_for_logprob_cpu=list(gathered),
        global_num_tokens_gpu=torch.zeros(len(gathered), dtype=torch.int64),
        global_num_tokens_for_logprob_gpu=torch.zeros(len(gathered), dtype=torch.int64),
        spec_info=SimpleNamespace(num_tokens_per_req=k, is_draft_input=lambda: False), lora_ids=[None] * bs,
    )
    runner = SimpleNamespace(
        mambaish_config=None, is_draft_worker=False, model_config=SimpleNamespace(hf_config=SimpleNamespace()),
        attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: 1),
        server_args=_server_args(speculative_algorithm="EAGLE", speculative_num_draft_tokens=server_k or k))
    parallel = SimpleNamespace(attn_tp_size=attn_tp, attn_dp_rank=dp_rank, attn_dp_size=2)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(fbi, "get_parallel", lambda: parallel))
        for mod in (sa_mod, fbi):  # the plugin reads it from server_args, the diff from forward_batch_info
            stack.enter_context(mock.patch.object(mod, "get_global_server_args", lambda: runner.server_args))
        stack.enter_context(mock.patch.object(cp, "get_cp_padding_align_size", lambda: 1))
        stack.enter_context(mock.patch.object(dpa, "get_attention_dp_size", lambda: 2))
        stack.enter_context(mock.patch.object(fbi, "set_dp_buffer_len", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "set_is_extend_in_batch", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "torch", _TorchWithoutPinnedMemory()))
        fb.prepare_mlp_sync_batch(runner)
    return fb


def _verify_rows(bs, k, attn_tp):
    fb = _prepare(bs, k, attn_tp)
    rows = fb.input_ids.shape[0]
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
    return _verify_rows(bs=1, k=4, attn_tp=8)


@scenario
def verify_padding_ranks_agree_draft_decode():
    return ranks_agree_draft_decode(_prepare)  # guard


# ---------------------------------------------------------------- seed 000 fixes 1 and 3 (guards)

@scenario
def dp_buffer_sizing_unreachable():
    """Seed fix 1 on 0.5.15: one-entry per-rank lists break get_dp_local_slice_cpu (IndexError), but the
    shipped configs never hand it one: a2a none -> require_mlp_tp_gather (full lists); deepep -> the
    capturer reads rows [0:N] without the list (and every layer stays scattered, no DP gather)."""
    import torch
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.layers.moe.utils as moe_utils
    import sglang.srt.state_capturer.routed_experts as re_mod
    from sglang.srt.utils.common import require_mlp_tp_gather

    fb = SimpleNamespace(global_num_tokens_cpu=[16], out_cache_loc=torch.arange(16))
    with mock.patch.object(dpa, "get_attention_dp_rank", lambda: 3):
        try:
            dpa.get_dp_local_slice_cpu(fb, False, None)
            shape = "no IndexError"
        except IndexError as e:
            shape = f"IndexError: {e}"
    seed = dict(enable_dp_attention=True, dp_size=4, tp_size=32, moe_dense_tp_size=1, enable_dp_lm_head=True)
    backend = lambda deepep: SimpleNamespace(is_none=lambda: not deepep, is_deepep=lambda: deepep)  # noqa: E731
    with mock.patch.object(moe_utils, "get_moe_a2a_backend", lambda: backend(False)):
        a2a_none_full = require_mlp_tp_gather(SimpleNamespace(**seed))
    with mock.patch.object(moe_utils, "get_moe_a2a_backend", lambda: backend(True)):
        deepep_one_entry = not require_mlp_tp_gather(SimpleNamespace(**seed))
    cap = _capturer(rows=64)
    with mock.patch.object(re_mod, "get_moe_a2a_backend", lambda: backend(True)), \
            mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True), \
            mock.patch.object(dpa, "get_attention_dp_rank", lambda: 3):
        rows = cap._get_local_slice(fb, True, None).shape[0]
    ok = shape.startswith("IndexError") and a2a_none_full and deepep_one_entry and rows == 16
    return {"ok": ok, "detail": f"one-entry list: {shape}; a2a none gathers full lists: {a2a_none_full}; "
                                f"deepep one-entry lists: {deepep_one_entry}; deepep capturer rows: {rows}"}


@scenario
def verify_logits_truncated():
    rows = verify_logits_rows()
    return {"ok": rows == (12, 12), "detail": f"logits / hidden rows after sync: {rows}, want (12, 12)"}


@scenario
def health_generate_needs_newer_message():
    """Seed fix 4: /health_generate only answers 200 for a message received after the probe began."""
    got = health_generate_codes()
    return {"ok": got == (200, 503, 503), "detail": f"old stamp+reply, old stamp, fresh stamp -> {got}"}


_FIXES = {
    "capturer-extent": {
        "capturer_extent_verify_graph": "stored gathered rows [2, 3, 4, 5, 6, 7, 8, 9], want",
        "capturer_extent_prefill_graph_first": NONE_MUL,
        "capturer_extent_prefill_graph_stale_bs": "stored gathered rows [2, 3,",
    },
    "routed-experts-rows": {"routed_experts_rows_verify": ROWS_MSG, "routed_experts_rows_prefill_graph": ROWS_MSG},
    "draft-extend-real-rows": {"draft_extend_real_rows": "q.shape[0] (8) does not match qo_indptr[-1] (4)",
                               "draft_extend_real_rows_k3": "q.shape[0] (16) does not match qo_indptr[-1] (12)"},
    "verify-padding-lcm": {"verify_padding_k3_attn_tp8": "8 padded rows, batch_size 2 x k 3 = 6",
                           "verify_padding_k6_attn_tp4": "20 padded rows, batch_size 3 x k 6 = 18"},
    "capture-snapshot": {"capture_snapshot_overlap": SNAPSHOT_STOCK},
}
_GUARDS = ["capturer_extent_eager_prefix_sum", "routed_experts_rows_default", "verify_padding_k4_attn_tp8",
           "verify_padding_ranks_agree_draft_decode", "dp_buffer_sizing_unreachable", "verify_logits_truncated",
           "health_generate_needs_newer_message"]
_STATES = {"capturer-extent": "active", "routed-experts-rows": "active", "draft-extend-real-rows": "active",
           "verify-padding-lcm": "active", "dp-buffer-sizing": "not-needed", "verify-logits-truncation": "upstream",
           "heartbeat-reset": "upstream", "padding-rows-capture": "not-needed", "capture-snapshot": "active"}
_SLIME_FIXES = dict(_FIXES, **{"capturer-extent": {  # slime's sglang.patch fixes the EAGLE-verify stride
    "capturer_extent_prefill_graph_first": NONE_MUL,
    "capturer_extent_prefill_graph_stale_bs": "stored gathered rows [8, 9,",
}})
EXPECT = {
    "0.5.15.post1": {"fixes": _FIXES, "guards": _GUARDS, "registered": list(_FIXES), "states": _STATES},
    "0.5.15.post1+slime": {"fixes": _SLIME_FIXES, "guards": _GUARDS + ["capturer_extent_verify_graph"],
                           "registered": list(_FIXES), "states": _STATES},
}

if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
