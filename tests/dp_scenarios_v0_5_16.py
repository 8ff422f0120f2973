"""The DP-attention scenarios on real SGLang 0.5.16 code (Miles' version), run like `dp_scenarios.py`
(plugin / none / source) by tests/test_version_matrix.py in `.venvs/sglang-0.5.16`.

0.5.16 differs from 0.5.23 where these scenarios touch it: the DP rank comes from
`dp_attention._ATTN_DP_RANK`, the schedule numbers from the published ServerArgs, and there are no
`get_schedule/get_exec/dp_slot_in/padded_extend_real_tokens`. The simulated context uses SGLang
0.5.16's own test overrides (`override_server_args`, `get_parallel().override`,
`get_flags().dp/moe.override`, `get_resources().override`); every function under test is SGLang's.
The `dp_buffer_*` scenarios decide seed fix 1 (`not-needed` on 0.5.16).

EXPECT["0.5.16"]: "fixes" {fix: {scenario: needle the stock detail must contain}}, "guards"
[scenarios right with and without the plugin], "latent" {scenario: needle}: a defect shape that is
there with and without the plugin but that no supported configuration reaches (see the guards),
"registered" (fixes the plugin hooks), "states" (dp-attention fix states in `patches status`).
"""
import sys
from contextlib import ExitStack, nullcontext
from types import SimpleNamespace
from unittest import mock

from dp_scenarios import SNAPSHOT_STOCK, _expect, capture_snapshot_overlap
from guard_scenarios import health_generate_codes, ranks_agree_draft_decode, verify_logits_rows
from scenario_runner import main, registry

SCENARIOS, scenario = registry()
scenario(capture_snapshot_overlap)  # same SGLang code as 0.5.15.post1 (sglang#34319 is after 0.5.16)

EXPECT = {"0.5.16": {
    "fixes": {
        "capturer-extent": {
            "capturer_extent_verify_graph": "stored gathered rows [2, 3, 4, 5, 6, 7, 8, 9]",
            "capturer_extent_prefill_graph_first": "unsupported operand type(s) for *: 'int' and 'NoneType'",
            "capturer_extent_prefill_graph_stale_bs": "stored gathered rows [4, 5, 6,",
        },
        "routed-experts-rows": {
            "routed_experts_rows_verify": "16384 rows into 4096: The expanded size of the tensor (4096)",
            "routed_experts_rows_prefill_graph": "8192 rows into 4096: The expanded size of the tensor (4096)",
            "routed_experts_rows_unchunked": "8192 rows into 512: The expanded size of the tensor (512)",
        },
        "draft-extend-real-rows": {"draft_extend_real_rows": "q.shape[0] (8) does not match qo_indptr[-1] (4)"},
        "verify-padding-lcm": {
            "verify_padding_k3_attn_tp8": "8 padded rows, batch_size 2 x k 3 = 6",
            "verify_padding_k6_attn_tp4": "20 padded rows, batch_size 3 x k 6 = 18",
        },
        "capture-snapshot": {"capture_snapshot_overlap": SNAPSHOT_STOCK},
    },
    "guards": ["capturer_extent_eager_prefix_sum", "routed_experts_rows_default", "draft_extend_unpadded_untouched",
               "verify_padding_k4_attn_tp8", "verify_padding_ranks_agree_draft_decode",
               "dp_buffer_seed_a2a_none_full_lists", "dp_buffer_seed_deepep_no_reader",
               "verify_logits_truncation_guard", "heartbeat_reset_guard"],
    "latent": {"dp_buffer_one_entry_list_latent": "IndexError: list index out of range"},
    "registered": ["capturer-extent", "routed-experts-rows", "draft-extend-real-rows", "verify-padding-lcm",
                   "capture-snapshot"],
    "states": {"capturer-extent": "active", "routed-experts-rows": "active", "draft-extend-real-rows": "active",
               "verify-padding-lcm": "active", "dp-buffer-sizing": "not-needed",
               "verify-logits-truncation": "upstream", "heartbeat-reset": "upstream",
               "padding-rows-capture": "not-needed", "capture-snapshot": "active"},
}}


def _context(stack, *, dp_rank=0, dp_size=1, attn_tp=1, a2a=None, **server_args):
    """DP slot of this process, attn-TP width, MoE a2a backend and published ServerArgs."""
    import sglang.srt.layers.dp_attention as dpa
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers.moe.utils import MoeA2ABackend

    stack.enter_context(mock.patch.object(dpa, "_ATTN_DP_RANK", dp_rank))
    stack.enter_context(mock.patch.object(dpa, "_ATTN_DP_SIZE", dp_size))
    stack.enter_context(rc.get_parallel().override(attn_dp_rank=dp_rank, attn_dp_size=dp_size, attn_tp_size=attn_tp,
                                                   tp_size=attn_tp * dp_size, attn_cp_size=1, attn_cp_rank=0))
    stack.enter_context(rc.get_flags().dp.override(enabled=True))
    stack.enter_context(rc.get_flags().moe.override(a2a_backend=MoeA2ABackend(a2a or "none")))
    fields = dict(enable_dp_attention=True, dp_size=dp_size, tp_size=attn_tp * dp_size, disable_overlap_schedule=True)
    fields.update(server_args)
    return stack.enter_context(rc.get_context().override_server_args(**fields))


# ---------------------------------------------------------------- capturer extent (seed 004)

def _capturer(rows, layers=1, topk=2):
    """A RoutedExpertsCapturer with SGLang's device cache and a plain host buffer."""
    import torch
    from sglang.srt.state_capturer.base import BaseDeviceCache
    from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

    cap = object.__new__(RoutedExpertsCapturer)
    cap.num_layers, cap.topk_size, cap.num_fused_shared_experts = layers, topk, 0
    cap.device_cache = BaseDeviceCache(rows, layers, topk, "cpu", name="routed_experts")
    cap.host_cache = SimpleNamespace(buffer=torch.full((256, layers, topk), -1, dtype=torch.int32))
    ids = torch.arange(rows, dtype=torch.int32)[:, None, None].expand(rows, layers, topk)
    cap.device_cache.buffer.copy_(ids)  # row i of the DP-gathered capture holds id i
    return cap


def _model_runner_forward(fb, *, cap, graph_extent, can_run_graph, decode_bs):
    """SGLang 0.5.16's ModelRunner.forward; its _forward_raw fills the batch through SGLang's
    buffer registry as a graph runner's load_batch does (or runs eager)."""
    import torch
    import sglang.srt.model_executor.model_runner as mr
    from sglang.srt import runtime_context as rc
    from sglang.srt.model_executor.cuda_graph_buffer_registry import CudaGraphBufferRegistry

    def forward_raw(forward_batch, *a, **kw):
        if graph_extent is not None:
            reg = CudaGraphBufferRegistry(device=torch.device("cpu"), max_bs=64, max_num_tokens=256)
            reg.fill_from(forward_batch, raw_bs=graph_extent, padded_bs=graph_extent,
                          raw_num_tokens=graph_extent, padded_num_tokens=graph_extent)
        return mr.ModelRunnerOutput(logits_output=None, can_run_graph=can_run_graph)

    runner = type("RunnerShell", (mr.ModelRunner,), {"__init__": lambda self: None})()
    runner.forward_pass_id, runner.msprobe_debugger, runner.canary_manager = 0, None, None
    runner.is_draft_worker, runner.enable_elastic_ep, runner.eplb_manager = False, False, None
    runner.server_args = rc.get_server_args()
    runner.decode_cuda_graph_runner = SimpleNamespace(bs=decode_bs) if decode_bs else SimpleNamespace()
    runner._forward_raw = forward_raw
    recorder = SimpleNamespace(with_forward_pass=lambda *a, **kw: nullcontext({}))
    with ExitStack() as stack:
        stack.enter_context(rc.get_resources().override(experts_capturer=cap, indexer_capturer=None))
        stack.enter_context(mock.patch.object(mr, "get_global_expert_distribution_recorder", lambda: recorder))
        stack.enter_context(mock.patch.object(mr, "build_step_span_name", lambda *a, **kw: "step"))
        mr.ModelRunner.forward(runner, fb)


def _capture_rows(*, dp_rank, dp_size, global_num_tokens, graph_extent, decode_bs, can_run_graph=True):
    import torch

    local = global_num_tokens[dp_rank]
    fb = SimpleNamespace(
        global_num_tokens_cpu=list(global_num_tokens),
        out_cache_loc=torch.arange(100, 100 + local),
        apply_deprecated_skip_attn_backend_init=lambda value: None,
        forward_mode=None,
    )
    with ExitStack() as stack:
        _context(stack, dp_rank=dp_rank, dp_size=dp_size)
        cap = _capturer(rows=dp_size * max(graph_extent or 0, sum(global_num_tokens)) + 8)
        _model_runner_forward(fb, cap=cap, graph_extent=graph_extent, can_run_graph=can_run_graph,
                              decode_bs=decode_bs)
    return cap.host_cache.buffer[100 : 100 + local, 0, 0].tolist()


@scenario
def capturer_extent_verify_graph():
    # EAGLE verify on the decode graph, k=4: rank 0 has 1 request, rank 1 has 2; graph bs 2.
    # The gathered stride is bs*k = 8 tokens; stock SGLang passes the decode runner's bs (2).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[4, 8], graph_extent=8, decode_bs=2)
    return _expect(got, list(range(8, 16)))


@scenario
def capturer_extent_prefill_graph_first():
    # Prefill-graph replay (opt-in --cuda-graph-backend-prefill) before any decode replay.
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=None)
    return _expect(got, list(range(16, 32)))


@scenario
def capturer_extent_prefill_graph_stale_bs():
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=4)
    return _expect(got, list(range(16, 32)))


@scenario
def capturer_extent_eager_prefix_sum():
    # Guard: eager forward, prefix-sum layout, whatever the decode runner last held.
    got = _capture_rows(dp_rank=2, dp_size=3, global_num_tokens=[4, 6, 5], graph_extent=None,
                        decode_bs=7, can_run_graph=False)
    return _expect(got, list(range(10, 15)))


# ---------------------------------------------------------------- routed-experts buffer rows

def _graph_config(prefill_bs):
    from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig

    prefill = PhaseConfig(backend=Backend.TC_PIECEWISE, max_bs=max(prefill_bs), bs=list(prefill_bs)) \
        if prefill_bs else PhaseConfig()
    return CudaGraphConfig(prefill=prefill, decode=PhaseConfig())


def _speculative(k):
    return dict(speculative_algorithm="EAGLE", speculative_num_draft_tokens=k) if k else {}


class _HostCache:
    """BaseHostCache pins its buffer; a CPU-only torch has no pinned memory."""

    def __init__(self, num_tokens, num_layers, topk_size, name):
        self.buffer = None


def _build_capturer(stack, *, cps, mrr, num_dp, attn_tp, k=None, prefill_bs=None, context_len=4096):
    """SGLang 0.5.16's RoutedExpertsCapturer.__init__ under published server args (per-rank cps)."""
    import sglang.srt.state_capturer.base as base
    import sglang.srt.state_capturer.routed_experts as re_mod

    _context(stack, dp_size=num_dp, attn_tp=attn_tp, chunked_prefill_size=cps, cuda_graph_config=_graph_config(prefill_bs),
             **_speculative(k))
    stack.enter_context(mock.patch.object(base, "BaseHostCache", _HostCache))
    model_config = SimpleNamespace(context_len=context_len,
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


def _rows_case(rows, **kw):
    with ExitStack() as stack:
        return _capture_ok(_build_capturer(stack, **kw), rows)


@scenario
def routed_experts_rows_verify():
    # EAGLE verify, k=4, every rank full: num_dp * mrr * k gathered rows (0.5.16's FIXME).
    return _rows_case(4 * 1024 * 4, cps=1024, mrr=1024, num_dp=4, attn_tp=8, k=4)


@scenario
def routed_experts_rows_prefill_graph():
    # The user sets --cuda-graph-max-bs-prefill 2048 above the per-rank chunk (1024): the
    # clamp in _handle_data_parallelism skips a locked max_bs, so buckets up to 2048 are captured.
    return _rows_case(4 * 2048, cps=1024, mrr=256, num_dp=4, attn_tp=8, prefill_bs=[512, 1024, 2048])


@scenario
def routed_experts_rows_unchunked():
    # chunked_prefill_size = -1 (stays -1 after the DP division): one long prompt per rank.
    return _rows_case(2 * 4096, cps=-1, mrr=256, num_dp=2, attn_tp=2, context_len=4096)


@scenario
def routed_experts_rows_default():
    return _rows_case(4 * 2048, cps=2048, mrr=256, num_dp=4, attn_tp=8)  # guard


# ---------------------------------------------------------------- eager draft extend (seed 000 fix 2)

def _draft_extend_batch(*, real, padded, planned, replan_equivalent=False):
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    fb = ForwardBatch(forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=1, input_ids=torch.arange(real),
                      req_pool_indices=torch.arange(1), seq_lens=torch.full((1,), 10),
                      out_cache_loc=torch.arange(real), seq_lens_sum=10, positions=torch.arange(real))
    fb.mark_forward_metadata_ready(replan_equivalent=replan_equivalent)  # as prepare_for_draft_extend
    assert fb.forward_metadata_planned_num_tokens == planned
    fb.global_num_tokens_cpu = [padded]  # what prepare_mlp_sync_batch leaves: padded inputs
    fb._original_batch_size = 1
    fb.input_ids = torch.arange(padded)
    fb.out_cache_loc = torch.arange(padded)
    fb.positions = torch.arange(padded)
    return fb


class _PlannedBackend:
    """flashinfer's extend check: the query rows must equal the planned rows (qo_indptr[-1])."""

    def __init__(self):
        self.seen = []

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        import torch

        self.seen.append((q.shape[0], forward_batch.out_cache_loc.shape[0]))
        if q.shape[0] != forward_batch.forward_metadata_planned_num_tokens:
            raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] "
                             f"({forward_batch.forward_metadata_planned_num_tokens})")
        return torch.ones(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def _radix_forward(fb, rows):
    import torch
    import sglang.srt.layers.radix_attention as ra

    backend = _PlannedBackend()
    layer = ra.RadixAttention(num_heads=2, head_dim=4, scaling=1.0, num_kv_heads=2, layer_id=0)
    q, k, v = torch.randn(rows, 8), torch.randn(rows, 8), torch.randn(rows, 8)
    with mock.patch.object(ra, "get_attn_backend", lambda: backend):
        try:
            out = layer.forward(q, k, v, fb)
        except ValueError as e:
            return None, backend.seen, str(e)
    return out.reshape(rows, -1), backend.seen, None


@scenario
def draft_extend_real_rows():
    # bs=1, k=4 padded to attn_tp 8 after the plan of 4 rows (prepare_for_draft_extend marks the
    # batch ready without replan_equivalent, so _forward_raw never re-plans after padding).
    fb = _draft_extend_batch(real=4, padded=8, planned=4)
    out, seen, err = _radix_forward(fb, 8)
    if err:
        return {"ok": False, "detail": err}
    ok = seen == [(4, 4)] and bool((out[4:] == 0).all()) and bool((out[:4] == 1).all()) \
        and fb.out_cache_loc.shape[0] == 8
    return {"ok": ok, "detail": f"backend saw (q rows, cache locs) {seen}; output rows {tuple(out.shape)}"}


@scenario
def draft_extend_unpadded_untouched():
    # Guard: a plan that already covers the padded rows runs on all of them.
    fb = _draft_extend_batch(real=8, padded=8, planned=8)
    out, seen, err = _radix_forward(fb, 8)
    return {"ok": err is None and seen == [(8, 8)], "detail": err or f"backend saw {seen}"}


# ---------------------------------------------------------------- verify padding (lcm)

def _verify_batch(bs, k, mode="TARGET_VERIFY", gathered=None):
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = bs * k
    gathered = gathered or [n]
    return ForwardBatch(
        forward_mode=ForwardMode[mode], batch_size=bs, input_ids=torch.arange(n),
        req_pool_indices=torch.arange(bs), seq_lens=torch.full((bs,), 10), out_cache_loc=torch.arange(n),
        seq_lens_sum=10 * bs, seq_lens_cpu=torch.full((bs,), 10), positions=torch.arange(n),
        global_num_tokens_cpu=list(gathered), global_num_tokens_for_logprob_cpu=list(gathered),
        global_num_tokens_gpu=torch.zeros(len(gathered), dtype=torch.int64),
        global_num_tokens_for_logprob_gpu=torch.zeros(len(gathered), dtype=torch.int64),
        spec_info=SimpleNamespace(num_tokens_per_req=k, is_draft_input=lambda: False),
    )


def _unpinned_tensor():
    import torch

    real = torch.tensor

    def tensor(*a, pin_memory=False, **kw):  # a CPU-only torch has no pinned memory
        return real(*a, **kw)

    return mock.patch.object(torch, "tensor", tensor)


def _prepare(bs, k, attn_tp, mode="TARGET_VERIFY", gathered=None, dp_rank=0, server_k=None):
    import sglang.srt.model_executor.forward_batch_info as fbi

    fb = _verify_batch(bs, k, mode, gathered)
    with ExitStack() as stack:
        sa = _context(stack, dp_rank=dp_rank, dp_size=2, attn_tp=attn_tp, cuda_graph_config=_graph_config(None),
                      **_speculative(server_k or k))
        runner = SimpleNamespace(
            server_args=sa, is_draft_worker=False, model_config=SimpleNamespace(hf_config=SimpleNamespace()),
            attn_backend=SimpleNamespace(get_cuda_graph_seq_len_fill_value=lambda: 1))
        stack.enter_context(_unpinned_tensor())
        stack.enter_context(mock.patch.object(fbi, "set_dp_buffer_len", lambda *a, **kw: None))
        stack.enter_context(mock.patch.object(fbi, "mambaish_config", lambda *a, **kw: None))
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
    return _verify_rows(bs=1, k=4, attn_tp=8)  # guard: the seed's k = 4


@scenario
def verify_padding_ranks_agree_draft_decode():
    return ranks_agree_draft_decode(_prepare)  # guard


# ---------------------------------------------------------------- seed 000 fixes 1, 3, 4 (guards)

SEED = dict(tp=32, dp=4, moe_dense_tp_size=1, enable_dp_lm_head=True)  # glm4.5-355b-a32b.yaml


def _local_slice(global_num_tokens, dp_rank, a2a):
    """SGLang's capturer slice on this DP rank (eager prefix-sum layout)."""
    import torch

    with ExitStack() as stack:
        _context(stack, dp_rank=dp_rank, dp_size=4, attn_tp=8, a2a=a2a)
        cap = _capturer(rows=64)
        fb = SimpleNamespace(global_num_tokens_cpu=global_num_tokens, out_cache_loc=torch.arange(16))
        s = cap._get_local_slice(fb, can_run_graph=False, cuda_graph_batch=None)
    return s[:, 0, 0].tolist()


@scenario
def dp_buffer_one_entry_list_latent():
    # The shape seed fix 1 is about: a one-entry per-rank list read on DP rank 3 (0.5.16 has
    # no dp_slot_in). Expected to fail on every tree: it documents the latent IndexError.
    try:
        return {"ok": True, "detail": f"rows {_local_slice([16], 3, None)}"}
    except IndexError as e:
        return {"ok": False, "detail": f"IndexError: {e}"}


def _gather_lists(a2a):
    """Does the seed configuration with this a2a backend gather full per-rank lists?"""
    from sglang.srt.utils.common import require_attn_tp_gather, require_mlp_tp_gather

    with ExitStack() as stack:
        sa = _context(stack, dp_size=SEED["dp"], attn_tp=SEED["tp"] // SEED["dp"], a2a=a2a,
                      moe_dense_tp_size=SEED["moe_dense_tp_size"], enable_dp_lm_head=SEED["enable_dp_lm_head"],
                      moe_a2a_backend=a2a or "none")
        return require_mlp_tp_gather(sa), require_attn_tp_gather(sa)


@scenario
def dp_buffer_seed_a2a_none_full_lists():
    # moe_a2a_backend none (glm4.5-355b-a32b.yaml): the MLP TP gather is on, so every per-rank
    # list has one entry per DP rank and rank 3 reads its own count.
    mlp, attn = _gather_lists(None)
    rows = _local_slice([16, 16, 16, 16], 3, None)
    ok = mlp and rows == list(range(48, 64))
    return {"ok": ok, "detail": f"require_mlp_tp_gather={mlp} require_attn_tp_gather={attn}; rank 3 rows {rows[:2]}.."}


@scenario
def dp_buffer_seed_deepep_no_reader():
    # deepep: only the attn-TP gather (one-entry lists), but no reader of a per-rank list runs:
    # every layer stays SCATTERED/TP_ATTN_FULL (no DP gather: get_dp_local_info is never called),
    # dp-lm-head turns the logits DP gather off, and the capturer takes its deepep slice.
    from sglang.srt.layers.communicator import LayerScatterModes, ScatterMode
    from sglang.srt.layers.logits_processor import LogitsProcessor

    mlp, attn = _gather_lists("deepep")
    with ExitStack() as stack:
        _context(stack, dp_size=4, attn_tp=8, a2a="deepep", moe_dense_tp_size=1, enable_dp_lm_head=True)
        num_layers, first_sparse = 92, 3  # GLM-4.5-355B: 3 dense + 89 MoE
        modes = set()
        for i in range(num_layers):
            m = LayerScatterModes.init_new(
                num_layers=num_layers, layer_id=i, is_layer_sparse=i >= first_sparse,
                is_previous_layer_sparse=(i - 1 >= first_sparse) if i else None,
                is_next_layer_sparse=(i + 1 >= first_sparse) if i + 1 < num_layers else None)
            modes |= {m.layer_input_mode, m.attn_mode, m.mlp_mode, m.middle_residual_mode, m.layer_output_mode}
        logits = LogitsProcessor(SimpleNamespace(vocab_size=151552))
    rows = _local_slice([16], 3, "deepep")
    ok = (not mlp and attn and ScatterMode.FULL not in modes
          and not logits.do_tensor_parallel_all_gather_dp_attn and rows == list(range(16)))
    return {"ok": ok, "detail": f"require_mlp_tp_gather={mlp} require_attn_tp_gather={attn}; layer modes "
                                f"{sorted(x.name for x in modes)}; logits DP gather "
                                f"{logits.do_tensor_parallel_all_gather_dp_attn}; capturer rows {rows[:2]}.."}


@scenario
def verify_logits_truncation_guard():
    # Seed fix 3: post_forward_mlp_sync_batch cuts padded verify logits to bs * k rows.
    rows = verify_logits_rows()
    return {"ok": rows == (12, 12), "detail": f"logits/hidden rows {rows}, want (12, 12)"}


@scenario
def heartbeat_reset_guard():
    # Seed fix 4: /health_generate needs a message received after the probe started.
    got = health_generate_codes()
    return {"ok": got == (200, 503, 503), "detail": f"status codes {got}, want (200, 503, 503)"}


if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
