"""The DP-attention scenarios: real SGLang code on the paths the fix set changes, on every release.

Run as a script in a fresh process (hooks are process-global), in one of three states:
    python -m sglang_patches.scenarios.dp plugin  # SGLang's own load_plugins() loads our entry point
    python -m sglang_patches.scenarios.dp none    # SGLANG_PLUGINS=none: stock SGLang
    python -m sglang_patches.scenarios.dp source  # no plugin; SGLang imported from PYTHONPATH (patched tree)
It prints one JSON object {scenario: {"ok": bool, "detail": str}}: "ok" means SGLang behaved correctly.
Only the distributed context is simulated, by the release's driver (`drivers.pick()`).

Each scenario belongs to a fix and is a `defect` (shows the defect where it exists), a `guard` (right
with and without the plugin) or a `reach` (why a not-needed defect cannot be reached). What a scenario
must do on a variant follows from that variant's port state (`expected()`); EXPECT_STOCK holds the
needle a defect's stock detail must contain, with per-variant differences.
"""
import sys
import traceback
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

from sglang_patches.scenarios.drivers import pick
from sglang_patches.scenarios.guards import health_generate_codes, verify_logits_rows
from sglang_patches.scenarios.runner import main

SCENARIOS = {}  # name -> function
KIND = {}  # name -> (fix name, "defect" | "guard" | "reach")
API = None  # the driver, chosen when the script runs


def scenario(fix, kind="defect"):
    def add(fn):
        SCENARIOS[fn.__name__] = fn
        KIND[fn.__name__] = (fix, kind)
        return fn

    return add


def _expect(got, want):
    return {"ok": got == want, "detail": f"stored gathered rows {got}, want {want}"}


# ---------------------------------------------------------------- capturer extent (sglang#31100)

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


def _model_runner_forward(stack, fb, *, cap, graph_extent, can_run_graph, decode_bs):
    """SGLang's ModelRunner.forward; its _forward_raw fills the batch through SGLang's buffer
    registry as a graph runner's load_batch does (or runs eager)."""
    import torch
    import sglang.srt.model_executor.model_runner as mr
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
    runner._forward_raw = forward_raw
    API.model_runner(stack, mr, runner, cap, decode_bs)
    mr.ModelRunner.forward(runner, fb)


def _capture_rows(*, dp_rank, dp_size, global_num_tokens, graph_extent, decode_bs, can_run_graph=True):
    """One forward on this DP rank; the gathered rows routed-expert capture stored for it."""
    import torch

    local = global_num_tokens[dp_rank]
    fb = SimpleNamespace(global_num_tokens_cpu=list(global_num_tokens), out_cache_loc=torch.arange(100, 100 + local),
                         out_cache_loc_virtual=None, apply_deprecated_skip_attn_backend_init=lambda value: None,
                         forward_mode=None)
    with ExitStack() as stack:
        API.dp_context(stack, dp_rank=dp_rank, dp_size=dp_size)
        cap = _capturer(rows=dp_size * max(graph_extent or 0, sum(global_num_tokens)) + 8)
        _model_runner_forward(stack, fb, cap=cap, graph_extent=graph_extent, can_run_graph=can_run_graph,
                              decode_bs=decode_bs)
    return cap.host_cache.buffer[100 : 100 + local, 0, 0].tolist()


@scenario("capturer-extent")
def capturer_extent_verify_graph():
    # EAGLE verify on the decode graph, k=4: rank 0 has 1 request, rank 1 has 2; graph bs 2.
    # The gathered stride is bs*k = 8 tokens; stock SGLang passes the decode runner's bs (2).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[4, 8], graph_extent=8, decode_bs=2)
    return _expect(got, list(range(8, 16)))


@scenario("capturer-extent")
def capturer_extent_prefill_graph_first():
    # Prefill-graph replay (opt-in --cuda-graph-backend-prefill) before any decode replay: no `bs` yet.
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=None)
    return _expect(got, list(range(16, 32)))


@scenario("capturer-extent")
def capturer_extent_prefill_graph_stale_bs():
    # Prefill-graph replay after decode replays: the decode runner's `bs` is stale (2 requests).
    got = _capture_rows(dp_rank=1, dp_size=2, global_num_tokens=[16, 16], graph_extent=16, decode_bs=2)
    return _expect(got, list(range(16, 32)))


@scenario("capturer-extent", "guard")
def capturer_extent_eager_prefix_sum():
    # Eager forward: prefix-sum layout, whatever the decode runner last held.
    got = _capture_rows(dp_rank=2, dp_size=3, global_num_tokens=[4, 6, 5], graph_extent=None,
                        decode_bs=7, can_run_graph=False)
    return _expect(got, list(range(10, 15)))


# ---------------------------------------------------------------- routed-experts buffer rows

def _rows_case(rows, *, cps, mrr, num_dp, attn_tp, k=None, prefill_bs=None, context_len=4096):
    """SGLang's RoutedExpertsCapturer.__init__ under the simulated schedule, then one capture of `rows`."""
    import torch
    import sglang.srt.state_capturer.routed_experts as re_mod

    with ExitStack() as stack:
        API.capturer_context(stack, cps=cps, num_dp=num_dp, attn_tp=attn_tp, k=k, prefill_bs=prefill_bs)
        model_config = SimpleNamespace(context_len=context_len,
                                       hf_text_config=SimpleNamespace(num_experts_per_tok=8, num_hidden_layers=2))
        cap = re_mod.RoutedExpertsCapturer(model_config, num_tokens=64, max_running_requests=mrr,
                                           num_fused_shared_experts=0, device="cpu")
        try:
            cap.capture(0, torch.zeros(rows, 8, dtype=torch.int32))
        except RuntimeError as e:
            return {"ok": False, "detail": f"{rows} rows into {cap.device_cache.buffer.shape[0]}: {e}"}
        return {"ok": True, "detail": f"{rows} rows fit in {cap.device_cache.buffer.shape[0]}"}


@scenario("routed-experts-rows")
def routed_experts_rows_verify():
    # EAGLE verify, k=4, every rank full: num_dp * mrr * k gathered rows (SGLang's FIXME).
    return _rows_case(4 * 1024 * 4, cps=1024, mrr=1024, num_dp=4, attn_tp=8, k=4)


@scenario("routed-experts-rows")
def routed_experts_rows_prefill_graph():
    # Prefill-graph buckets up to 2048 above the per-rank chunked prefill size (1024).
    return _rows_case(4 * 2048, cps=1024, mrr=256, num_dp=4, attn_tp=8, prefill_bs=[512, 1024, 2048])


@scenario("routed-experts-rows")
def routed_experts_rows_unchunked():
    # chunked_prefill_size = -1: one long prompt per rank.
    return _rows_case(2 * 4096, cps=-1, mrr=256, num_dp=2, attn_tp=2, context_len=4096)


@scenario("routed-experts-rows", "guard")
def routed_experts_rows_default():
    return _rows_case(4 * 2048, cps=2048, mrr=256, num_dp=4, attn_tp=8)


# ---------------------------------------------------------------- eager draft extend (sglang#26016)

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


def _draft_extend(*, real, padded, planned):
    """RadixAttention.forward on an eager draft-extend batch padded from `real` to `padded` rows after a
    plan of `planned` rows: the backend must get the planned rows, the rest of the output is zero."""
    import torch
    import sglang.srt.layers.radix_attention as ra

    fb = API.draft_extend_batch(real=real, padded=padded, planned=planned)
    layer = ra.RadixAttention(num_heads=2, head_dim=4, scaling=1.0, num_kv_heads=2, layer_id=0)
    q, k, v = torch.randn(padded, 8), torch.randn(padded, 8), torch.randn(padded, 8)
    backend = PlannedBackend()
    try:
        with ExitStack() as stack:
            API.attention_context(stack, ra, backend, fb)
            out = layer.forward(q, k, v, fb)
    except ValueError as e:
        return {"ok": False, "detail": str(e)}
    out = out.reshape(padded, -1)
    ok = backend.seen == [planned] and bool((out[planned:] == 0).all()) and bool((out[:planned] == 1).all())
    ok = ok and fb.out_cache_loc.shape[0] == padded  # the batch is left as it was
    return {"ok": ok, "detail": f"backend saw {backend.seen} rows; output rows {tuple(out.shape)}"}


@scenario("draft-extend-real-rows")
def draft_extend_real_rows():
    return _draft_extend(real=4, padded=8, planned=4)  # bs 1, k 4 padded to attn_tp 8 after the plan


@scenario("draft-extend-real-rows")
def draft_extend_real_rows_k3():
    return _draft_extend(real=12, padded=16, planned=12)  # bs 4, k 3 padded to attn_tp 8


@scenario("draft-extend-real-rows", "guard")
def draft_extend_unpadded_untouched():
    return _draft_extend(real=8, padded=8, planned=8)  # a plan that covers every row runs on all of them


# ---------------------------------------------------------------- verify padding (lcm)

def _prepare(bs, k, attn_tp, mode="TARGET_VERIFY", gathered=None, dp_rank=0, server_k=None):
    """Stock `prepare_mlp_sync_batch` on DP rank `dp_rank` of a gather of `gathered` per-rank counts."""
    import torch
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
        spec_info=SimpleNamespace(num_tokens_per_req=k, is_draft_input=lambda: False), **API.batch_extra(bs))
    with ExitStack() as stack:
        runner = API.prepare_context(stack, attn_tp=attn_tp, dp_rank=dp_rank, width=max(2, len(gathered)),
                                     k=server_k or k)
        try:
            fb.prepare_mlp_sync_batch(runner)
        except Exception as e:  # noqa: BLE001 - report whatever stock SGLang raises
            return fb, f"{type(e).__name__}: {e} " + traceback.format_exc(limit=-2).replace("\n", " | ")
    return fb, None


def _verify_rows(bs, k, attn_tp):
    fb, err = _prepare(bs, k, attn_tp)
    if err:
        return {"ok": False, "detail": err}
    rows = fb.input_ids.shape[0]
    return {"ok": rows == fb.batch_size * k,
            "detail": f"{rows} padded rows, batch_size {fb.batch_size} x k {k} = {fb.batch_size * k}"}


@scenario("verify-padding-lcm")
def verify_padding_k3_attn_tp8():
    return _verify_rows(bs=1, k=3, attn_tp=8)


@scenario("verify-padding-lcm")
def verify_padding_k6_attn_tp4():
    return _verify_rows(bs=3, k=6, attn_tp=4)


@scenario("verify-padding-lcm", "guard")
def verify_padding_k4_attn_tp8():
    return _verify_rows(bs=1, k=4, attn_tp=8)  # k divides attn_tp: whole requests already


def _ranks_padded(mode, width, bs):
    """attn_tp 2, k 3 (configuration (c)): a busy rank and an idle one whose spec input has the same
    phase's width must pad the gathered list alike, to whole requests (draft decode: to its bs)."""
    g = [bs * width, 0]
    (busy, e1), (idle, e2) = (_prepare(bs, width, 2, mode, gathered=g, dp_rank=0, server_k=3),
                              _prepare(0, width, 2, "IDLE", gathered=g, dp_rank=1, server_k=3))
    if e1 or e2:
        return {"ok": False, "detail": e1 or e2}
    lists = [getattr(busy, API.padded_list), getattr(idle, API.padded_list)]
    rows = busy.input_ids.shape[0]
    whole = rows == busy.batch_size * width and (width > 1 or busy.batch_size == bs)
    return {"ok": lists[0] == lists[1] and whole,
            "detail": f"padded lists {lists[0]} / {lists[1]} (busy / idle rank); busy rank {rows} rows, "
                      f"batch_size {busy.batch_size} x {width}"}


@scenario("verify-padding-lcm")
def verify_padding_ranks_agree_verify():
    return _ranks_padded("TARGET_VERIFY", 3, bs=1)


@scenario("verify-padding-lcm", "guard")
def verify_padding_ranks_agree_draft_decode():
    return _ranks_padded("DECODE", 1, bs=4)  # 1 token a request: 4 requests stay 4 rows


# ---------------------------------------------------------------- capture snapshot (sglang#34319)

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


@scenario("capture-snapshot")
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


# ---------------------------------------------------------------- sglang#26016's other changes

GLM = dict(tp=32, dp=4, moe_dense_tp_size=1, enable_dp_lm_head=True)  # training_configs glm4.5-355b-a32b


def _local_slice(global_num_tokens, dp_rank, a2a):
    """SGLang's capturer slice on this DP rank (eager prefix-sum layout)."""
    import torch

    with ExitStack() as stack:
        API.dp_context(stack, dp_rank=dp_rank, dp_size=4, attn_tp=8, a2a=a2a)
        cap = _capturer(rows=64)
        fb = SimpleNamespace(global_num_tokens_cpu=global_num_tokens, out_cache_loc=torch.arange(16))
        s = cap._get_local_slice(fb, can_run_graph=False, cuda_graph_batch=None)
    return s[:, 0, 0].tolist()


@scenario("dp-buffer-sizing")
def dp_buffer_one_entry_list():
    # A one-entry per-rank list read on DP rank 3: without dp_slot_in SGLang indexes it by rank.
    try:
        rows = _local_slice([16], 3, None)
    except IndexError as e:  # the defect: SGLang's DP-local slice indexes the one-entry list by DP rank
        at = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{at.filename.rsplit('/', 1)[-1].removesuffix('.py')}.{at.name}: {at.line.strip()}"
        return {"ok": False, "detail": f"IndexError at {where}: {e}"}
    return {"ok": rows == list(range(16)), "detail": f"rows {rows[:2]}.. of {len(rows)}"}


def _gather_lists(stack, a2a):
    sa = API.dp_context(stack, dp_size=GLM["dp"], attn_tp=GLM["tp"] // GLM["dp"], a2a=a2a,
                        moe_dense_tp_size=GLM["moe_dense_tp_size"], enable_dp_lm_head=GLM["enable_dp_lm_head"],
                        moe_a2a_backend=a2a or "none")
    return sa, API.gather_flags(stack, sa)


@scenario("dp-buffer-sizing", "reach")
def dp_buffer_glm_a2a_none_full_lists():
    # moe_a2a_backend none: the MLP TP gather is on, so every per-rank list has one entry per DP rank, and the
    # MoE layers run FULL (what the deepep scenario's layer-mode check must tell apart).
    with ExitStack() as stack:
        sa, (mlp, attn) = _gather_lists(stack, None)
        modes = {"FULL"}
        if API.layer_context is not None:
            API.layer_context(stack, sa, a2a=None, dp_size=GLM["dp"], attn_tp=GLM["tp"] // GLM["dp"])
            modes = _layer_modes(stack)[0]
    rows = _local_slice([16, 16, 16, 16], 3, None)
    return {"ok": mlp and "FULL" in modes and rows == list(range(48, 64)),
            "detail": f"require_mlp_tp_gather={mlp} require_attn_tp_gather={attn}; layer modes {sorted(modes)}; "
                      f"rank 3 rows {rows[:2]}.."}


@scenario("dp-buffer-sizing", "reach")
def dp_buffer_glm_deepep_no_reader():
    # deepep: only the attn-TP gather (one-entry lists), but no reader of a per-rank list runs: every
    # layer stays SCATTERED/TP_ATTN_FULL, dp-lm-head turns the logits DP gather off, and the capturer
    # takes its deepep slice.
    if API.layer_context is None:
        return {"ok": False, "detail": f"layer modes are not simulated by the {API.release} driver"}
    with ExitStack() as stack:
        sa, (mlp, attn) = _gather_lists(stack, "deepep")
        API.layer_context(stack, sa, a2a="deepep", dp_size=GLM["dp"], attn_tp=GLM["tp"] // GLM["dp"])
        modes, logits_gather = _layer_modes(stack)
    rows = _local_slice([16], 3, "deepep")
    ok = not mlp and attn and "FULL" not in modes and not logits_gather and rows == list(range(16))
    return {"ok": ok, "detail": f"require_mlp_tp_gather={mlp} require_attn_tp_gather={attn}; layer modes "
                                f"{sorted(modes)}; logits DP gather {logits_gather}; capturer rows {rows[:2]}.."}


def _layer_modes(stack):
    """Scatter modes of every GLM-4.5-355B layer (3 dense + 89 MoE) and the logits DP gather flag."""
    from sglang.srt.layers.communicator import LayerScatterModes
    from sglang.srt.layers.logits_processor import LogitsProcessor

    num_layers, first_sparse = 92, 3
    modes = set()
    for i in range(num_layers):
        m = LayerScatterModes.init_new(
            num_layers=num_layers, layer_id=i, is_layer_sparse=i >= first_sparse,
            is_previous_layer_sparse=(i - 1 >= first_sparse) if i else None,
            is_next_layer_sparse=(i + 1 >= first_sparse) if i + 1 < num_layers else None)
        modes |= {m.layer_input_mode, m.attn_mode, m.mlp_mode, m.middle_residual_mode, m.layer_output_mode}
    logits = LogitsProcessor(SimpleNamespace(vocab_size=151552))
    return {x.name for x in modes}, logits.do_tensor_parallel_all_gather_dp_attn


@scenario("verify-logits-truncation", "guard")
def verify_logits_truncation_guard():
    rows = verify_logits_rows()  # post_forward_mlp_sync_batch cuts padded verify logits to bs * k rows
    return {"ok": rows == (12, 12), "detail": f"logits/hidden rows {rows}, want (12, 12)"}


@scenario("heartbeat-reset", "guard")
def heartbeat_reset_guard():
    got = health_generate_codes(API.health_patches())  # /health_generate needs a message received after the probe started
    return {"ok": got == (200, 503, 503), "detail": f"status codes {got}, want (200, 503, 503)"}


# ---------------------------------------------------------------- draft-decode token count (sglang#40156)

DRAFT_BS, DRAFT_TOPK = 2, 2


class _Unset:
    """A duck-typed ScheduleBatch: the fields a draft-decode batch has; every other field unset."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _draft_decode_batch():
    """A draft worker's decode batch as the scheduler leaves it: 2 requests x top-k 2, no input ids yet."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs, k = DRAFT_BS, DRAFT_TOPK
    spec = SimpleNamespace(num_tokens_per_req=k, num_tokens_for_logprob_per_req=k, capture_hidden_mode=None)
    return _Unset(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([9] * bs), seq_lens_cpu=torch.tensor([9] * bs),
                  input_ids=None, req_pool_indices=torch.arange(bs), out_cache_loc=torch.arange(bs * k * 3),
                  seq_lens_sum=9 * bs, reqs=[], spec_info=spec, return_logprob=False, return_hidden_states=False,
                  return_hidden_states_before_norm=False, has_grammar=False)


def _draft_runner():
    """The fields of a draft ModelRunner that init_new reads (stand-in)."""
    return SimpleNamespace(device="cpu", is_draft_worker=True, use_ngram_embedding=False, model_is_mrope=False,
                           server_args=SimpleNamespace(enable_lora=False), lora_manager=None,
                           ngram_embedding_manager=SimpleNamespace(enabled=False),
                           kv_index_translator=SimpleNamespace(  # the KV-index plan binds nothing here
                               rebind_write_loc=lambda fb: None,
                               own_plan=lambda fb: SimpleNamespace(bind=lambda *a, **kw: None)),
                           attn_dcp_size=1,
                           model_config=SimpleNamespace(is_encoder_decoder=False, model_is_mrope=False,
                                                        requires_mm_token_modalities=False),
                           ps=SimpleNamespace(attn_dcp_size=1))


@scenario("draft-token-count")
def draft_token_count():
    # SGLang's own token count of the batch (moe_ep_size 4 arms it), then its padded-region mask with it.
    import torch
    import sglang.srt.model_executor.forward_batch_info as fbi
    from sglang.srt.layers.moe import topk

    real = DRAFT_BS * DRAFT_TOPK
    with mock.patch.object(fbi, "get_parallel", lambda: SimpleNamespace(moe_ep_size=4, attn_dcp_size=1)):
        count = int(API.draft_count(_draft_decode_batch(), _draft_runner()))
    ids = torch.tensor([[1, 5], [2, 6], [3, 7], [4, 0]], dtype=torch.int32)  # the draft tokens' top-k
    with mock.patch.object(topk, "_can_fuse_padded_region", lambda t: False, create=True):  # no triton on CPU
        topk._mask_topk_ids_padded_region(ids, torch.tensor(count, dtype=torch.int32))
    masked = int(ids.eq(-1).all(-1).sum())
    return {"ok": count == real and masked == 0,
            "detail": f"draft decode {DRAFT_BS} requests x top-k {DRAFT_TOPK}: num_token_non_padded {count} of {real} "
                      f"tokens; {masked} of {real} draft tokens' top-k ids masked to -1"}


# ---------------------------------------------------------------- capture rows of an EAGLE tree (sglang#37949)

class _Launch:
    """`kernel[grid](*args)` of a triton kernel: the CPU engine's torch op of the same contract
    (sglang_patches.cpu.sgl_kernel_cpu) on the first `nargs` arguments."""

    def __init__(self, fn, nargs):
        self.fn, self.nargs = fn, nargs

    def __getitem__(self, grid):
        return lambda *args: self.fn(*args[: self.nargs])


def _fill_front(num_front, out_cache_loc, front):
    """The first num_front[i] slots of request i's window in out_cache_loc, packed (the kernel's contract)."""
    import torch

    window = out_cache_loc.view(num_front.numel(), -1)
    packed = torch.cat([window[i, :n] for i, n in enumerate(num_front.tolist())])
    front[: packed.numel()] = packed


def _kv_move_kernels(stack, spec_utils):
    """The KV move's triton kernels (whichever names this release uses) as the CPU engine's ops."""
    from sglang_patches.cpu.sgl_kernel_cpu.cache_ops import assign_extend_cache_locs_cpu
    from sglang_patches.cpu.sgl_kernel_cpu.spec_ops import fill_accept_out_cache_loc_cpu

    subs = {"_is_cpu": False, "assign_extend_cache_locs": _Launch(assign_extend_cache_locs_cpu, 6),
            "fill_accept_out_cache_loc": _Launch(fill_accept_out_cache_loc_cpu, 3),
            "fill_accept_out_cache_loc_func": lambda idx, loc, out, size: fill_accept_out_cache_loc_cpu(idx, loc, out),
            "fill_front_out_cache_loc_func": _fill_front}  # 0.5.23: the targets from the verify window
    for name, value in subs.items():
        if hasattr(spec_utils, name):
            stack.enter_context(mock.patch.object(spec_utils, name, value))


def _accepted_rows(accept):
    """One EAGLE verify of 1 request, 4 tree tokens in KV slots 20..23 captured as rows 100..103; SGLang's
    capturer writes the host rows, its `move_accept_tokens_to_target_kvcache` moves the accepted nodes' KV
    to the front of the window (top-k > 1 and ngram do this), `get_topk` reads the request's rows."""
    import torch
    from sglang.srt.speculative import spec_utils
    from sglang.srt.state_capturer import routed_experts as re_mod

    window = torch.arange(20, 24)
    cap = _capturer(rows=4)
    cap.device_cache.buffer.copy_(torch.arange(100, 104, dtype=torch.int32)[:, None, None].expand(4, 1, 2))
    with mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: False):
        cap.on_forward_end(SimpleNamespace(out_cache_loc=window, out_cache_loc_virtual=None),
                           can_run_graph=False, cuda_graph_batch=None)
    kv = torch.arange(64)  # a KV pool's rows: slot s holds s
    kvcache = SimpleNamespace(move_kv_cache=lambda tgt, src: kv.index_copy_(0, tgt, kv[src].clone()))
    pool = SimpleNamespace(req_to_token=torch.tensor([[0] * 9 + window.tolist()]))
    batch = SimpleNamespace(seq_lens=torch.tensor([9]), out_cache_loc=window, req_pool_indices=torch.tensor([0]),
                            req_to_token_pool=pool)
    accept_index = torch.tensor([accept + [-1] * (4 - len(accept))], dtype=torch.int32)
    with ExitStack() as stack:
        _kv_move_kernels(stack, spec_utils)
        spec_utils.move_accept_tokens_to_target_kvcache(batch, accept_index,
                                                        torch.tensor([len(accept) - 1], dtype=torch.int32),
                                                        SimpleNamespace(get_kvcache=lambda: kvcache))
    n = len(accept)
    moved_kv = kv[window[:n]].tolist()  # KV at the request's front slots: the accepted nodes' slots
    rows = cap.get_topk(0, 9 + n + 1, pool, start_len=9).reshape(-1, 2)[:n, 0].tolist()
    want = [100 + i for i in accept]
    return {"ok": rows == want and moved_kv == [20 + i for i in accept],
            "detail": f"accepted tree nodes {accept}: KV moved from slots {moved_kv}; routed rows {rows}, want {want}"}


@scenario("accepted-path-rows")
def accepted_path_rows_topk2():
    return _accepted_rows([0, 2])  # top-k 2: the root, then the second branch's draft token


@scenario("accepted-path-rows", "guard")
def accepted_path_rows_topk1():
    return _accepted_rows([0, 1, 2])  # top-k 1 (every supported config): the chain's prefix, already in front


# ---------------------------------------------------------------- padding rows captured (sglang#36404)

PAD_ROUTE = [7, 9]  # what the router makes of a padding token


def _padding_rows(graph: bool) -> dict:
    """DP rank 1 of 2, 3 real tokens padded to 8 by MLP sync: SGLang's capture site stores the padding rows'
    routes, its host copy sends them to KV slot 0 (out_cache_loc is zero-padded), which the allocator never
    hands out, so `get_topk` over a request's slots reads only real rows. Eager, or replaying a decode graph
    of batch 8."""
    import inspect

    import torch
    from sglang.srt.layers.moe import topk
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    padded_with_zeros = "self.out_cache_loc = self._pad_tensor_to_size(self.out_cache_loc, num_tokens)" \
        in inspect.getsource(ForwardBatch)
    slots = ForwardBatch._pad_tensor_to_size(None, torch.tensor([100, 101, 102]), 8)
    fb = SimpleNamespace(global_num_tokens_cpu=[8, 8], out_cache_loc=slots, out_cache_loc_virtual=None)
    real = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    gathered = torch.cat([torch.tensor([[10, 11]], dtype=torch.int32).expand(8, 2), real,
                          torch.tensor(PAD_ROUTE, dtype=torch.int32).expand(5, 2)])  # rank 0's 8 rows, then ours
    cap = _capturer(rows=16)
    with ExitStack() as stack:
        API.dp_context(stack, dp_rank=1, dp_size=2)
        stack.enter_context(mock.patch.object(topk, "get_global_experts_capturer", lambda: cap))
        topk._post_process_topk_ids(gathered.clone(), torch.ones(16, 2), topk.TopKConfig(top_k=2), router_logits=None,
                                    layer_id=0, num_token_non_padded=torch.tensor(11))
        cap.on_forward_end(fb, can_run_graph=graph, cuda_graph_batch=8 if graph else None)
    captured = cap.device_cache.buffer[11:16, 0].tolist() == [PAD_ROUTE] * 5
    slot0 = cap.host_cache.buffer[0, 0].tolist()
    payload = cap.get_topk(0, 4, SimpleNamespace(req_to_token=torch.tensor([[100, 101, 102, 103]]))).reshape(3, 2)
    alloc = TokenToKVPoolAllocator(size=16, dtype=torch.int64, device="cpu", kvcache=None, need_sort=False)
    slot0_free = 0 not in alloc.alloc(16).tolist() and alloc.alloc(1) is None
    ok = padded_with_zeros and captured and slot0 == PAD_ROUTE and payload.tolist() == real.tolist() and slot0_free
    return {"ok": ok, "detail": f"out_cache_loc zero-padded {padded_with_zeros}; padding routes captured {captured}; "
                                f"slot 0 holds {slot0}; payload {payload.tolist()}; slot 0 never allocated {slot0_free}"}


@scenario("padding-rows-capture", "reach")
def padding_rows_eager():
    return _padding_rows(graph=False)


@scenario("padding-rows-capture", "reach")
def padding_rows_decode_graph():
    return _padding_rows(graph=True)


# ---------------------------------------------------------------- what each variant must show

NONE_MUL = "unsupported operand type(s) for *: 'int' and 'NoneType'"
ROWS = "must match the existing size"
SNAPSHOT_STOCK = "host rows of slots 10..14 [900, 101, 102, 103, 900]"
# scenario -> needle its stock detail contains where the defect is there (hooked or not-needed)
EXPECT_STOCK = {
    "capturer_extent_verify_graph": "stored gathered rows [2, 3, 4, 5, 6, 7, 8, 9], want",
    "capturer_extent_prefill_graph_first": NONE_MUL,
    "capturer_extent_prefill_graph_stale_bs": "stored gathered rows [2, 3, 4,",
    "routed_experts_rows_verify": "16384 rows into 4096: The expanded size of the tensor (4096) " + ROWS,
    "routed_experts_rows_prefill_graph": "8192 rows into 4096: The expanded size of the tensor (4096) " + ROWS,
    "routed_experts_rows_unchunked": "8192 rows into 512: The expanded size of the tensor (512) " + ROWS,
    "draft_extend_real_rows": "q.shape[0] (8) does not match qo_indptr[-1] (4)",
    "draft_extend_real_rows_k3": "q.shape[0] (16) does not match qo_indptr[-1] (12)",
    "verify_padding_k3_attn_tp8": "8 padded rows, batch_size 2 x k 3 = 6",
    "verify_padding_k6_attn_tp4": "20 padded rows, batch_size 3 x k 6 = 18",
    "verify_padding_ranks_agree_verify": "busy rank 4 rows, batch_size 1 x 3",
    "capture_snapshot_overlap": SNAPSHOT_STOCK,
    "dp_buffer_one_entry_list": "IndexError at dp_attention.get_dp_local_slice_cpu: local_num_tokens = "
                                "global_num_tokens[dp_rank]: list index out of range",
    "draft_token_count": "num_token_non_padded 0 of 4 tokens; 4 of 4 draft tokens' top-k ids masked to -1",
    "accepted_path_rows_topk2": "accepted tree nodes [0, 2]: KV moved from slots [20, 22]; routed rows [100, 101], "
                                "want [100, 102]",
}
# variant -> {scenario: needle, or None: right on that stock tree (a guard there)}
EXPECT_VARIANT = {
    "0.5.15.post1+slime": {  # slime's sglang.patch multiplies bs by the decode runner's tokens per request (4)
        "capturer_extent_verify_graph": None, "capturer_extent_prefill_graph_stale_bs": "stored gathered rows [8, 9,"},
}


def expected(variant: str) -> dict:
    """{scenario: (stock needle or None, plugin ok)} on `variant`, from its port table: a hooked fix's
    defects fail stock with the needle and pass with the plugin; an upstream or absent fix's defects
    pass both; a not-needed fix's defects fail both (its `reach` scenarios say why nothing reaches them)."""
    from sglang_patches.registry import VARIANTS, table
    from sglang_patches.states import FixState

    ports = table(next(v for v in VARIANTS if v.name == variant).table)
    needles = {**EXPECT_STOCK, **EXPECT_VARIANT.get(variant, {})}
    out = {}
    for name, (fix, kind) in KIND.items():
        state = ports[fix].state
        if kind == "reach":
            if state is FixState.NOT_NEEDED:
                out[name] = (None, True)
        elif kind == "guard" or state in (FixState.UPSTREAM, FixState.ABSENT) or needles[name] is None:
            out[name] = (None, True)
        else:
            out[name] = (needles[name], state is FixState.ACTIVE)
    return out


def run(state: str, scenarios: dict = SCENARIOS) -> None:
    """`scenarios` (this list, or one that contains it: scenarios/every.py) in `state`, with the release's driver."""
    global API
    API = pick()
    main(scenarios, state, meta={"driver": API.release})


if __name__ == "__main__":
    run(sys.argv[1])
