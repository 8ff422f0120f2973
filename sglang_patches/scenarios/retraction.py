"""Retraction scenarios: real SGLang code on the path of a retracted request's routed experts, on every release.

Run in a fresh process (hooks are process-global), like `sglang_patches.scenarios.dp`:
    python -m sglang_patches.scenarios.retraction both   # stock SGLang, then SGLang's own load_plugins() and again
It prints one JSON object {"none": {...}, "plugin": {...}}; "ok" means the rows describe the sampled tokens.

SGLang's own code runs: `schedule_batch.release_req` (with `Req.reset_for_retract`), the capturer's
`get_topk` and the scheduler's `_maybe_collect_routed_experts`. Simulated: the forwards (they write the
capturer's host rows as `on_forward_end` does: the row of a token lives at its KV slot, and slot s of a
forward numbered f holds id f*100 + s), the KV free itself (`release_kv_cache`, `evict_from_tree_cache`:
the stand-in marks the row released as each release's own does) and the request (a duck-typed Req with the
fields those functions read). One request, 4 prompt tokens, row 0 of the request-to-token table.
The `retraction_routes_*` scenarios run a re-prefill batch through SGLang's own `Scheduler.run_batch` (on a
scheduler shell; the plugin's plan hook wraps it) whose forward is one router through SGLang's `select_experts`.
`retraction_state_stamped` runs SGLang's own `TokenizerManager._wait_one_response` (the state hook wraps it).
"""
import inspect
import sys
from contextlib import ExitStack
from types import MethodType, SimpleNamespace
from unittest import mock

from sglang_patches.scenarios.runner import main

SCENARIOS = {}
PROMPT = 4


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


class DuckReq(SimpleNamespace):
    """A duck-typed SGLang object (a Req, a batch, a forward's result): the fields given, every other unset (None)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _kv_row_on_req():
    """0.5.15.post1-0.5.18 keep the pool row on the Req; 0.5.19+ on `req.kv`."""
    from sglang.srt.managers.scheduler_components import batch_result_processor as bp

    return "req.req_pool_idx" in inspect.getsource(bp.SchedulerBatchResultProcessor._maybe_collect_routed_experts)


class Engine:
    """One request's life: forwards write host rows, retractions run SGLang's release_req, finish collects."""

    def __init__(self, stack, start_len=0, custom_params=None):
        import torch
        from sglang.srt.managers import schedule_batch as sb
        from sglang.srt.state_capturer.base import BaseDeviceCache
        from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer, set_global_experts_capturer

        cap = object.__new__(RoutedExpertsCapturer)
        cap.num_layers, cap.topk_size, cap.num_fused_shared_experts = 1, 2, 0
        cap.device_cache = BaseDeviceCache(8, 1, 2, "cpu", name="routed_experts")
        cap.host_cache = SimpleNamespace(buffer=torch.full((128, 1, 2), -1, dtype=torch.int32))
        set_global_experts_capturer(cap)
        stack.callback(set_global_experts_capturer, None)
        self.cap, self.sb = cap, sb
        self.pool = SimpleNamespace(req_to_token=torch.zeros((2, 64), dtype=torch.int64))
        self.on_req = _kv_row_on_req()
        kv = None if self.on_req else SimpleNamespace(req_pool_idx=0, holds_kv=True)
        self.req = DuckReq(return_routed_experts=True, routed_experts_start_len=start_len,
                           origin_input_ids=list(range(PROMPT)), output_ids=[], kv=kv,
                           req_pool_idx=0 if self.on_req else None, retraction_count=0, weight_version_events=[],
                           send_token_offset=0, rid="r0", sampling_params=SimpleNamespace(custom_params=custom_params))
        self.req.reset_for_retract = MethodType(sb.Req.reset_for_retract, self.req)  # SGLang's own
        stack.enter_context(mock.patch.object(sb, "release_kv_cache", self._free, create=True))
        stack.enter_context(mock.patch.object(sb, "evict_from_tree_cache", lambda *a, **k: None, create=True))
        if hasattr(sb, "get_disagg"):
            stack.enter_context(mock.patch.object(sb, "get_disagg",
                                                  lambda: SimpleNamespace(disaggregation_mode="null")))

    def _free(self, req, tree_cache, **kw):
        if self.on_req:
            req.req_pool_idx, req.kv = None, None
        else:
            req.kv.req_pool_idx, req.kv.holds_kv = None, False

    def _set_row(self, idx):
        if self.on_req:
            self.req.req_pool_idx = idx
        else:
            self.req.kv.req_pool_idx, self.req.kv.holds_kv = idx, True

    def forward(self, f, first_pos, n, first_slot, sample=1):
        """Forward number `f` computes positions [first_pos, first_pos + n) into slots from `first_slot` and
        samples `sample` tokens (prefill and re-prefill: 1; decode: 1)."""
        for i in range(n):
            slot = first_slot + i
            self.pool.req_to_token[0, first_pos + i] = slot
            self.cap.host_cache.buffer[slot] = f * 100 + slot
        self.req.output_ids = self.req.output_ids + [7] * sample

    def decode(self, f, n, first_slot):
        """`n` decode steps: each computes the last token's position."""
        for i in range(n):
            self.forward(f, PROMPT + len(self.req.output_ids) - 1, 1, first_slot + i)

    def retract(self):
        kw = dict(req=self.req, remaing_req_count=1, req_to_token_pool=self.pool, token_to_kv_pool_allocator=None,
                  tree_cache=None, hisparse_coordinator=None)
        params = inspect.signature(inspect.unwrap(self.sb.release_req)).parameters
        if "server_args" in params:
            kw["server_args"] = SimpleNamespace(disaggregation_mode="null")
        self.sb.release_req(**kw)

    def reprefill(self, f, first_slot):
        """The re-prefill: every position of the prompt and the kept output tokens, into new slots."""
        self._set_row(0)
        self.forward(f, 0, PROMPT + len(self.req.output_ids), first_slot)

    def finish(self):
        import numpy as np
        from sglang.srt.managers.scheduler_components import batch_result_processor as bp

        self.req.output_ids_through_stop = list(self.req.output_ids)
        shell = object.__new__(bp.SchedulerBatchResultProcessor)
        for name, value in (("req_to_token_pool", self.pool), ("model_config", MODEL_CONFIG)):
            object.__setattr__(shell, name, value)  # a frozen dataclass on some releases
        bp.SchedulerBatchResultProcessor._maybe_collect_routed_experts(shell, self.req)
        rows = self.req.routed_experts
        self.compact = rows.dtype == torch_uint8()
        if self.compact:  # the compact wire feature's payload: header, then int16 rows
            raw = rows.numpy().tobytes()
            return np.frombuffer(raw[int.from_bytes(raw[4:6], "little"):], np.int16).reshape(-1, 2)[:, 0].tolist()
        return rows[:, 0, 0].tolist()


def torch_uint8():
    import torch

    return torch.uint8


# 1 MoE layer, top-2 of 1,024 experts: the compact feature sends int16 rows
MODEL_CONFIG = SimpleNamespace(hf_text_config={"num_hidden_layers": 1, "num_experts_per_tok": 2,
                                               "n_routed_experts": 1024})


def _expect(got, want):
    return {"ok": got == want, "detail": f"routed rows {got}, want {want}"}


def _first_life(e):
    """Prefill (forward 1, slots 10..13), 2 decode steps (forward 2, slots 14, 15): 3 output tokens."""
    e.forward(1, 0, PROMPT, 10)
    e.decode(2, 2, 14)


def _retracted(e, decode_after=1):
    """The first life, a retraction, the re-prefill into slots 30..36 (forward 5), then `decode_after` decode
    steps from slot 37 (forward 6)."""
    _first_life(e)
    e.retract()
    e.reprefill(5, 30)
    e.decode(6, decode_after, 37)


@scenario
def retraction_rows_kept():
    # Retracted after 3 output tokens (rows of positions 0..5 sampled in slots 10..15), re-prefilled into
    # slots 30..36 (forward 5), 1 more decode step (slot 37): positions 0..5 must keep their first rows.
    with ExitStack() as stack:
        e = Engine(stack)
        _retracted(e)
        return _expect(e.finish(), [110, 111, 112, 113, 214, 215, 536, 637])


@scenario
def retraction_rows_start_len():
    # routed_experts_start_len 2: rows from position 2 on, the kept ones included.
    with ExitStack() as stack:
        e = Engine(stack, start_len=2)
        _retracted(e)
        return _expect(e.finish(), [112, 113, 214, 215, 536, 637])


@scenario
def retraction_rows_twice():
    # Retracted again after the first re-prefill and one decode step: the first rows stay for positions
    # 0..5, the rows sampled between the retractions (positions 6, 7) follow, then the second re-prefill's.
    with ExitStack() as stack:
        e = Engine(stack)
        _retracted(e)
        e.retract()
        e.reprefill(8, 50)
        return _expect(e.finish(), [110, 111, 112, 113, 214, 215, 536, 637, 858])


@scenario
def retraction_rows_finish_in_reprefill():
    # The request finishes in its re-prefill (its last token is sampled there).
    with ExitStack() as stack:
        e = Engine(stack)
        _retracted(e, decode_after=0)
        return _expect(e.finish(), [110, 111, 112, 113, 214, 215, 536])


@scenario
def retraction_rows_compact_wire():
    # The request also asks for the compact wire format: the kept rows are what gets compacted.
    from sglang_patches.features.routed_experts_wire import OPT_IN_KEY, OPT_IN_VALUE

    with ExitStack() as stack:
        e = Engine(stack, custom_params={OPT_IN_KEY: OPT_IN_VALUE})
        _retracted(e)
        got = _expect(e.finish(), [110, 111, 112, 113, 214, 215, 536, 637])
        return {"ok": got["ok"] and e.compact, "detail": f"{got['detail']} (compact payload: {e.compact})"}


@scenario
def retraction_rows_mid_prefill():
    # Retracted in the middle of a chunked prefill (positions 0, 1 of 4 computed, nothing sampled): the
    # re-prefill's rows, with or without the plugin (positions 2, 3 had no rows to keep).
    with ExitStack() as stack:
        e = Engine(stack)
        e.forward(1, 0, 2, 10, sample=0)
        e.retract()
        e.reprefill(5, 30)
        e.decode(6, 1, 34)
        return _expect(e.finish(), [530, 531, 532, 533, 634])


GUARDS = ("retraction_rows_never_retracted", "retraction_rows_recomputed_opt_out", "retraction_rows_mid_prefill")


@scenario
def retraction_rows_never_retracted():
    with ExitStack() as stack:
        e = Engine(stack)
        _first_life(e)
        e.decode(3, 1, 16)
        return _expect(e.finish(), [110, 111, 112, 113, 214, 215, 316])


@scenario
def retraction_rows_recomputed_opt_out():
    # custom_params asks for SGLang's rows (the "recomputed" rule): the re-prefill's rows, as stock.
    from sglang_patches.fixes.retraction_rows import RECOMPUTED, RULE_KEY

    with ExitStack() as stack:
        e = Engine(stack, custom_params={RULE_KEY: RECOMPUTED})
        _retracted(e)
        return _expect(e.finish(), [530, 531, 532, 533, 534, 535, 536, 637])


# ---- SGLang's own Scheduler.run_batch on a shell scheduler -----------------------------------------------------
class Null:
    """A scheduler part whose answer nobody reads (metrics, profiler, copies to CPU): every call and attribute
    answers itself, falsy."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *a, **k):
        return self

    def __bool__(self):
        return False


class ExtendMode:
    """A batch's forward mode: extend (`is_extend()` true, every other `is_*()` false)."""

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda: name == "is_extend"
        raise AttributeError(name)


def run_batch(forward, batch, server_args):
    """SGLang's own `Scheduler.run_batch` (with whatever hooks the plugin installed on it) for an extend batch,
    on a scheduler shell: no overlap, no speculation, no disaggregation, the last pipeline rank; its model
    worker's forward is `forward(batch)` (0.5.20+ read `scheduler_stage_metrics` too)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    shell = object.__new__(Scheduler)
    worker = SimpleNamespace(forward_batch_generation=lambda b, **kw: DuckReq(out=forward(b)))
    vars(shell).update(
        forward_ct=0, _sched_idled=False, processed_tokens_counter=0, metrics_reporter=Null(),
        scripted_scheduler_hook=None, profiler_manager=Null(), forward_sleep_time=None,
        disaggregation_mode=DisaggregationMode.NULL, is_generation=True, enable_overlap=False, enable_pdmux=False,
        enable_unified_memory=False, enable_unified_cache_external_linker=False,
        spec_algorithm=SimpleNamespace(is_none=lambda: True), future_map=None,
        pp_group=SimpleNamespace(is_last_rank=True), model_worker=worker, update_cache_from_scheduler=Null(),
        _copy_auxiliary_output_to_cpu=Null(), _maybe_report_active_ranks=Null(), _relay_forward_payload=Null(),
        _copy_result_to_cpu=Null(), server_args=server_args, tp_cpu_group=None, scheduler_stage_metrics=None)
    return Scheduler.run_batch(shell, batch)


# ---- retraction-routes: the re-prefill's routers take the kept rows (SGLang's own select_experts) ------------
EXPERTS, LAYER = 8, 1


def _reprefill_routes(server_args=None, gather=None, **config):
    """A re-prefill batch through SGLang's `select_experts` (torch-native top-2 of 8, sigmoid with a correction
    bias, renormalized, 2.5 routed scaling, as GLM-4.5), under the plan `retraction-routes` makes when the
    scheduler runs the batch. Batch: another request's 2 new positions, then the retracted request's positions
    2..6 (0, 1 cached) with kept rows for positions 0..5 (the least likely experts, so stock routes differ).
    `gather` (DP attention): (counts, padded) per DP slot as the release publishes them; this process is slot 1
    of 2 (the release's own slot lookup), the routers see slot 0's `padded` rows first, and slot 0's plan (kept
    rows for its rows 1, 2) arrives from the exchange. Returns (ids of the routers' rows, their weights, the
    capturer's rows, the kept ids of every planned row in order, the logits, the planned rows)."""
    import torch
    from sglang.srt.layers.moe import topk
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    from sglang_patches.fixes.retraction_rows import KEPT
    from sglang_patches.scenarios.dp import _capturer

    torch.manual_seed(0)
    logits = torch.randn(7, EXPERTS)
    kept = logits.argsort(-1)[2:6, :2].to(torch.int32)            # positions 2..5: the two least likely
    kept_rows = torch.zeros((6, 2, 2), dtype=torch.int32)
    kept_rows[2:6, LAYER] = kept
    planned, kept_all = list(range(2, 6)), kept.tolist()
    with ExitStack() as stack:
        if gather is not None:
            counts, before = gather
            other = torch.randn(before, EXPERTS)
            kept0 = torch.zeros((2, 2, 2), dtype=torch.int32)
            kept0[:, LAYER] = other.argsort(-1)[1:3, :2]
            slot0 = (torch.tensor([1, 2]), kept0)
            _gather_context(stack, counts, lambda group, slot, plan: {0: slot0, slot: plan})
            logits = torch.cat([other, logits])
            planned, kept_all = [1, 2] + [before + r for r in planned], kept0[:, LAYER].tolist() + kept_all
        cap = _capturer(max(8, logits.shape[0]), layers=2)
        set_global_experts_capturer(cap)
        cfg = topk.TopKConfig(top_k=2, renormalize=True, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                              correction_bias=torch.zeros(EXPERTS), routed_scaling_factor=2.5, torch_native=True,
                              **config)
        batch = DuckReq(forward_mode=ExtendMode(), spec_algorithm=SimpleNamespace(is_none=lambda: True),
                        prefix_lens=[0, 2], extend_lens=[2, 5], reqs=[DuckReq(), DuckReq(**{KEPT: (0, kept_rows)})],
                        is_extend_in_batch=True, device="cpu", extend_num_tokens=7,
                        prefill_input_ids_cpu=torch.zeros(7, dtype=torch.int64))
        routed = []

        def forward(_batch):   # the batch's forward: one MoE layer's router
            routed.append(topk.select_experts(hidden_states=torch.zeros(logits.shape[0], 4), router_logits=logits,
                                              topk_config=cfg, layer_id=LAYER))
        try:
            run_batch(forward, batch, server_args or SimpleNamespace(enable_dp_attention=False))
            out = routed[0]
            captured = cap.device_cache.buffer[:logits.shape[0], LAYER].tolist()
        finally:
            set_global_experts_capturer(None)
    return out.topk_ids.tolist(), out.topk_weights, captured, kept_all, logits, planned


def _gather_context(stack, counts, exchange):
    """This process is DP slot 1 of 2 (the release's driver), the gather's counts published by the release's
    own `set_dp_buffer_len`, and the exchange answered for slot 0 (the other rank's half of the all-gather)."""
    import sglang.srt.layers.dp_attention as dpa

    from sglang_patches.fixes import retraction_routes
    from sglang_patches.scenarios.drivers import pick

    pick().dp_context(stack, dp_rank=1, dp_size=2)
    wrapper = dpa._DpGatheredBufferWrapper
    for name in ("_global_dp_buffer_len", "_local_dp_buffer_len", "_dp_max_padding", "_global_num_tokens",
                 "_global_num_tokens_gpu"):
        if name in vars(wrapper):
            stack.enter_context(mock.patch.object(wrapper, name, getattr(wrapper, name)))
    dpa.set_dp_buffer_len(sum(counts), counts[1], len(set(counts)) == 1, counts)
    stack.enter_context(mock.patch.object(retraction_routes, "exchange", exchange))


def _natural(logits):
    return logits.topk(2, dim=-1).indices.tolist()


def _forced(ids, weights, captured, kept, logits, planned):
    """ok when the planned rows route with their kept experts (weights: the router's sigmoid scores there,
    renormalized), every other row as the router chooses, and the capturer holds the same."""
    import torch

    want = _natural(logits)
    for row, experts in zip(planned, kept):
        want[row] = experts
    scores = logits[planned].sigmoid().gather(1, torch.tensor(kept))
    right = torch.allclose(weights[planned], scores / scores.sum(-1, keepdim=True), atol=1e-4)
    got = [ids[r] for r in planned]
    return {"ok": ids == want and captured == want and right,
            "detail": f"re-prefill routes {got}, want the kept {kept}; captured {[captured[r] for r in planned]}; "
                      f"the kept experts' weights the router's {right}"}


@scenario
def retraction_routes_reprefill():
    # The retracted request's positions 2..5 (batch rows 2..5) route with their kept rows; the other
    # request's rows and position 6 (computed for the first time) route as the router chooses.
    return _forced(*_reprefill_routes())


_DP_ARGS = dict(enable_dp_attention=True, enable_return_routed_experts=True, moe_a2a_backend="none")


@scenario
def retraction_routes_dp_attention():
    # DP attention, the gather unpadded: the routers see slot 0's 3 rows, then this slot's 7; both slots'
    # retracted requests route with their kept rows, each at its slot's offset.
    return _forced(*_reprefill_routes(SimpleNamespace(**_DP_ARGS), gather=([3, 7], 3)))


@scenario
def retraction_routes_dp_padded():
    # DP attention, every slot padded to the longest (MAX_LEN): this slot's rows start at 7.
    return _forced(*_reprefill_routes(SimpleNamespace(**_DP_ARGS), gather=([7, 7], 7)))


@scenario
def retraction_routes_draft():
    # A draft model's router (no capture) is left alone.
    ids, _, _, _, logits, _ = _reprefill_routes(allow_routed_experts_capture=False)
    return {"ok": ids == _natural(logits), "detail": f"routes {ids}, want the router's {_natural(logits)}"}


def _reprefill_match(routed=True):
    """(the retracted request's radix key, how many tokens of another request's cached prompt its re-prefill's
    match reuses): SGLang's own `release_req`, then its `RadixCache.match_prefix` on a tree where another
    request (the same prompt, prefilled after the retraction with its own routes) cached its prompt."""
    import torch
    from array import array
    from sglang.srt.mem_cache.radix_cache import InsertParams, MatchPrefixParams, RadixCache, RadixKey

    with ExitStack() as stack:
        e = Engine(stack)
        e.req.return_routed_experts = routed
        _first_life(e)
        e.retract()
        tree = RadixCache.create_simulated()
        prompt = array("q", e.req.origin_input_ids)
        tree.insert(InsertParams(key=RadixKey(prompt, None), value=torch.arange(50, 50 + PROMPT)))
        tokens = array("q", e.req.origin_input_ids + e.req.output_ids)
        hit = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, e.req.extra_key)))
        # 0.5.23 reports a length (the indices lie on the node path), earlier releases the indices
        return e.req.extra_key, getattr(hit, "device_prefix_len", None) or len(getattr(hit, "device_indices", ()))


@scenario
def retraction_routes_own_prefix():
    # Retracted after 3 tokens, its rows kept: its re-prefill must compute its prefix with the kept routes, not
    # reuse the prompt another request cached meanwhile (no plan forces reused positions).
    key, hit = _reprefill_match()
    return {"ok": hit == 0 and str(key).startswith("slime-moe-rollout-kept:r0"),
            "detail": f"re-prefill key {key!r} reuses {hit} cached tokens of another request's prefill"}


@scenario
def retraction_routes_own_prefix_unkept():
    # No routed experts asked for: nothing kept, the request shares the cache as SGLang does.
    key, hit = _reprefill_match(routed=False)
    return {"ok": key is None and hit == PROMPT,
            "detail": f"re-prefill key {key!r} reuses {hit} cached tokens of another request's prefill"}


GUARDS += ("retraction_routes_draft", "retraction_routes_own_prefix_unkept")

# ---- retraction-rows' state: SGLang's own TokenizerManager._wait_one_response ----------------------------------
def wait_one_response(outs, custom_params=None):
    """The answers SGLang's own `TokenizerManager._wait_one_response` (with whatever hooks the plugin installed
    on it) yields for one non-streaming request whose scheduler outputs are `outs`, on a tokenizer manager shell
    (one request state; no logging, no metrics)."""
    import asyncio

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    async def answers():
        tm, event = object.__new__(TokenizerManager), asyncio.Event()
        state = SimpleNamespace(out_list=[], finished=False, event=event, get_text=lambda: "",
                                time_stats=SimpleNamespace(response_sent_to_client_time=1.0),
                                customized_info_accumulated={}, customized_info_reported_keys=set())
        obj = SimpleNamespace(rid="r0", stream=False, background=False,
                              sampling_params={"custom_params": custom_params})
        vars(tm).update(rid_to_state={"r0": state}, server_args=SimpleNamespace(incremental_streaming_output=False),
                        incremental_streaming_output=False, request_logger=Null(),
                        request_metrics_exporter_manager=Null())

        async def feed():   # the detokenizer's side: each output appended, the state's event set
            for i, out in enumerate(outs):
                await asyncio.sleep(0)
                state.out_list.append(out)
                state.finished = i == len(outs) - 1
                event.set()
                await asyncio.sleep(0.01)
        task = asyncio.create_task(feed())
        got = [out async for out in TokenizerManager._wait_one_response(tm, obj, None)]
        await task
        return got

    return asyncio.run(answers())


def sent(req) -> dict:
    """The request's `customized_info` as the scheduler's streamer sends it in its finishing chunk (each key's
    slice from `send_token_offset` to the end of `output_ids_through_stop`, every reviewed release) and the
    tokenizer manager puts it into meta_info (one chunk: accumulated = sent). A stand-in for the transport
    (BatchTokenIDOutput / BatchStrOutput carry the dict pickled); tests/test_retraction_rows.py pins those
    lines of every release's source."""
    end = len(req.output_ids_through_stop)
    return {k: v[req.send_token_offset or 0: end] for k, v in (req.customized_info or {}).items()}


def _answer_of(e, custom_params=None):
    """The request finishes (SGLang's collect, the plugin's hooks), its evidence travels, and SGLang's own
    `_wait_one_response` (the state hook) yields the answer's meta_info."""
    e.finish()
    meta = {"routed_experts": "AAAA", "finish_reason": None, "num_retractions": e.req.retraction_count, **sent(e.req)}
    return wait_one_response([{"text": "x", "meta_info": meta}], custom_params)[-1]["meta_info"]


def _stamp(meta, want_rule, **want):
    from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, META_KEY

    rule, word = meta.get(META_KEY), meta.get(EVIDENCE_KEY)
    ok = rule == want_rule and isinstance(word, dict) and all(
        (v(word.get(k)) if callable(v) else word.get(k) == v) for k, v in want.items())
    return {"ok": ok, "detail": f"stamp {rule!r}, evidence {word!r}, want {want_rule!r}"}


@scenario
def retraction_state_kept():
    # Retracted once after 3 output tokens: the scheduler kept rows for positions 0..5 and says so; the answer
    # is stamped sampling-time with that evidence.
    from sglang_patches.fixes.retraction_rows import SAMPLING_TIME

    with ExitStack() as stack:
        e = Engine(stack)
        _retracted(e)
        return _stamp(_answer_of(e), SAMPLING_TIME, retractions=1, kept_rows=6)


@scenario
def retraction_state_capped():
    # The per-request cap (40 bytes: less than the 6 kept rows of 1 layer x top-2 int32, 48 bytes) turns the
    # fix off at the retraction: the rows are SGLang's, and the answer must say "recomputed", not sampling-time.
    import os

    from sglang_patches.fixes.retraction_rows import PER_REQUEST_ENV, RECOMPUTED

    with ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {PER_REQUEST_ENV: str(40 / (1 << 20))}))
        e = Engine(stack)
        _retracted(e)
        return _stamp(_answer_of(e), RECOMPUTED, why=lambda w: isinstance(w, str) and "caps" in w)


@scenario
def retraction_state_stamped():
    # A finished answer carrying routed experts names the rule of its rows (sampling-time by default).
    from sglang_patches.fixes.retraction_rows import META_KEY, SAMPLING_TIME

    got = wait_one_response([{"text": "x", "meta_info": {"routed_experts": "AAAA", "finish_reason": None}}])
    keys = [sorted(out["meta_info"]) for out in got]
    rule = [out["meta_info"].get(META_KEY) for out in got]
    return {"ok": rule == [SAMPLING_TIME], "detail": f"answer meta_info keys {keys}, {META_KEY} {rule}"}


# scenario -> the rows stock SGLang returns (the re-prefill's rows for the pre-retraction positions)
EXPECT_STOCK = {
    "retraction_rows_kept": "routed rows [530, 531, 532, 533, 534, 535, 536, 637]",
    "retraction_rows_start_len": "routed rows [532, 533, 534, 535, 536, 637]",
    "retraction_rows_twice": "routed rows [850, 851, 852, 853, 854, 855, 856, 857, 858]",
    "retraction_rows_finish_in_reprefill": "routed rows [530, 531, 532, 533, 534, 535, 536]",
    "retraction_rows_compact_wire": "routed rows [530, 531, 532, 533, 534, 535, 536, 637]",
    "retraction_routes_reprefill": "re-prefill routes [[7, 3], [5, 4], [6, 7], [5, 4]], want the kept [[1, 5], "
                                   "[7, 1], [0, 2], [7, 2]]",   # the router's own top-2, not the kept pair
    "retraction_routes_dp_attention": "re-prefill routes [[0, 3], [6, 4], [7, 3], [5, 4], [6, 7], [5, 4]], want "
                                      "the kept [[4, 5], [7, 5], [1, 5], [7, 1], [0, 2], [7, 2]]",
    "retraction_routes_dp_padded": "re-prefill routes [[7, 6], [4, 2], [7, 3], [5, 4], [6, 7], [5, 4]], want "
                                   "the kept [[2, 1], [1, 7], [1, 5], [7, 1], [0, 2], [7, 2]]",
    "retraction_routes_own_prefix": "re-prefill key None reuses 4 cached tokens of another request's prefill",
    "retraction_state_kept": "stamp None, evidence None",
    "retraction_state_capped": "stamp None, evidence None",   # (before the scheduler's word: 'sampling-time')
    "retraction_state_stamped": "answer meta_info keys [['finish_reason', 'routed_experts']], "
                                "routed_experts_retraction [None]",   # no key: the client cannot tell
}


if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
