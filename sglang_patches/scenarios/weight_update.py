"""Weight-update scenarios: SGLang's own code on slime's update sequence (pause with an empty body, flush, update,
continue), on every release; "ok" means the requests in flight are kept.

Run in a fresh process (hooks are process-global), like the other lists:
    python -m sglang_patches.scenarios.weight_update both

SGLang's own code runs: `TokenizerManager.pause_generation` and `abort_request` (on a tokenizer-manager shell:
the scheduler link records what is sent), the `/update_weight_version` HTTP handler, `Scheduler.flush_cache` with
its own `is_fully_idle` (on a scheduler shell: a paused engine whose retracted request waits, the pools record
their resets). The engine itself is not started (tests/test_weight_update_pause_engine.py does that).
"""
import asyncio
import os
import sys
from types import SimpleNamespace
from unittest import mock

from sglang_patches.scenarios.runner import main

SCENARIOS = {}
KIND = {}   # name -> "defect" (fails stock where the fix is hooked) | "guard" (right in both states)
ABORTED = "aborted every request in flight"
FLUSH_REFUSED = "flush_cache refused with 1 retracted request waiting"


def scenario(kind):
    def add(fn):
        SCENARIOS[fn.__name__] = fn
        KIND[fn.__name__] = kind
        return fn

    return add


class Link:
    """The tokenizer manager's scheduler link: records every object sent."""

    def __init__(self):
        self.sent = []

    def sync(self, obj):
        self.sent.append(obj)

    async def send(self, obj):
        self.sent.append(obj)

    def summary(self) -> str:
        return ", ".join(f"{type(o).__name__}({_fields(o)})" for o in self.sent) or "nothing"


def _fields(obj) -> str:
    if type(obj).__name__ == "AbortReq":
        return f"abort_all={obj.abort_all}"
    return f"mode={getattr(obj, 'mode', None)}"


class _Args(SimpleNamespace):
    """The tokenizer manager's server args: fields, and 0.5.16's `override(source, **fields)`."""

    def override(self, source, **fields):
        self.__dict__.update(fields)


class _Unlocked:
    async def is_locked(self):
        return False


def tokenizer_manager(routed_experts=True):
    """A TokenizerManager shell with the fields pause_generation / abort_request read; (shell, link)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    link = Link()
    tm = object.__new__(TokenizerManager)
    tm.server_args = _Args(enable_return_routed_experts=routed_experts, tokenizer_worker_num=1, weight_version="1")
    tm.is_pause, tm.is_pause_cond, tm.model_update_lock = False, asyncio.Condition(), _Unlocked()
    tm.rid_to_state, tm.enable_metrics = {}, False
    tm._dispatch_to_scheduler, tm._async_dispatch_to_scheduler = link.sync, link.send
    return tm, link


def _pause_empty_body(env=None):
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    tm, link = tokenizer_manager()
    with mock.patch.dict(os.environ, env or {}):
        asyncio.run(tm.pause_generation(PauseGenerationReqInput()))   # slime posts {}
    return link


@scenario("defect")
def weight_pause_empty_body_keeps_requests():
    """slime's pause (an empty body) on an engine that returns routed experts: retract, no abort."""
    link = _pause_empty_body()
    kept = [type(o).__name__ for o in link.sent] == ["PauseGenerationReqInput"] and link.sent[0].mode == "retract"
    why = "" if kept else f": the pause {ABORTED}" if "AbortReq" in link.summary() else ""
    return {"ok": kept, "detail": f"pause sent {link.summary()}{why}"}


@scenario("guard")
def weight_pause_abort_switch_aborts():
    """rollout.weight_update_pause: abort keeps SGLang's abort-mode pause."""
    from sglang_patches.fixes.weight_update_pause import ENV

    link = _pause_empty_body({ENV: "abort"})
    ok = [(type(o).__name__, getattr(o, "abort_all", None)) for o in link.sent] == [("AbortReq", True)]
    return {"ok": ok, "detail": f"pause sent {link.summary()}"}


@scenario("defect")
def weight_version_publish_keeps_requests():
    """/update_weight_version with its default body after a pause: the version is published, nothing aborted."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

    tm, link = tokenizer_manager()
    published = []

    async def update_weight_version(obj):   # 0.5.23: the label's own path (not what this scenario is about)
        published.append(obj.new_version)

    tm.update_weight_version = update_weight_version
    tm.record_config_updates = lambda source, **fields: published.append(fields.get("weight_version"))  # 0.5.17+
    with mock.patch.object(http_server, "_global_state", SimpleNamespace(tokenizer_manager=tm)):
        resp = asyncio.run(http_server.update_weight_version(UpdateWeightVersionReqInput(new_version="2"), None))
    version = published[-1] if published else tm.server_args.weight_version
    aborted = any(type(o).__name__ == "AbortReq" for o in link.sent)
    detail = f"HTTP {resp.status_code}, version {version}, sent {link.summary()}" + (f": {ABORTED}" if aborted else "")
    return {"ok": resp.status_code == 200 and version == "2" and not aborted, "detail": detail}


class _Stub:
    """Any pool, cache or reporter flush_cache resets: every call recorded, nothing else."""

    def __init__(self, name, calls):
        self._name, self._calls = name, calls

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: self._calls.append(f"{self._name}.{attr}")


def scheduler(waiting, paused=True):
    """A paused Scheduler shell after a retract-mode pause: nothing running, `waiting` in the queue; (shell, calls)."""
    from sglang.srt.managers.scheduler import Scheduler

    class Shell(Scheduler):
        def __getattr__(self, name):   # a feature switch this shell does not set is off
            if name.startswith("enable_"):
                return False
            raise AttributeError(name)

    calls = []
    s = object.__new__(Shell)
    for name in ("tree_cache", "req_to_token_pool", "token_to_kv_pool_allocator", "metrics_reporter",
                 "draft_worker", "disagg_prefill_inflight_queue"):
        setattr(s, name, _Stub(name, calls))
    s.draft_worker = None
    s.grammar_manager = SimpleNamespace(grammar_queue=[], clear=lambda: calls.append("grammar_manager.clear"))
    s.running_batch = SimpleNamespace(is_empty=lambda: True, reqs=[])
    s.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
    s.chunked_req = s.last_batch = s.cur_batch = None
    s.enable_overlap, s.result_queue, s.waiting_queue, s._engine_paused = False, [], waiting, paused
    s._pp_microbatches_drained = lambda: True
    s.pp_size, s.enable_hierarchical_cache, s.enable_hicache_storage = 1, False, False
    from sglang.srt.disaggregation.utils import DisaggregationMode

    s.disaggregation_mode = DisaggregationMode.NULL
    s.metrics_reporter = SimpleNamespace(reset_metrics=lambda: calls.append("metrics_reporter.reset_metrics"),
                                         is_stats_logging_rank=False)
    s.tp_rank, s.attn_tp_rank = 0, 0
    return s, calls


def retracted():
    """A retracted request in the waiting queue: its tokens kept, no KV held (0.5.19+ ask `req.kv`)."""
    return SimpleNamespace(rid="r0", kv=SimpleNamespace(holds_kv=False), req_pool_idx=None)


@scenario("defect")
def weight_pause_flush_with_retracted_waiting():
    """slime's /flush_cache after a retract-mode pause: the cache is flushed, the retracted request still waits."""
    req = retracted()
    s, calls = scheduler([req])
    ok = s.flush_cache(empty_cache=False)
    kept = s.waiting_queue == [req]
    if not ok:
        return {"ok": False, "detail": f"{FLUSH_REFUSED} (resets: {calls or 'none'})"}
    return {"ok": kept and "tree_cache.reset" in calls,
            "detail": f"flushed (resets: {', '.join(calls)}); waiting queue {[r.rid for r in s.waiting_queue]}"}


@scenario("guard")
def weight_pause_flush_unpaused_refused():
    """Not paused, a request waiting: flush_cache refuses, as stock (the fix touches paused engines only)."""
    s, calls = scheduler([retracted()], paused=False)
    ok = s.flush_cache(empty_cache=False)
    return {"ok": ok is False and not calls, "detail": f"flush_cache -> {ok} (resets: {calls or 'none'})"}


def expected(variant: str) -> dict:
    """{scenario: (stock needle or None, plugin ok)}: a defect fails stock with its needle where the fix hooks its
    target there (the flush: before 0.5.21); a guard, or a defect SGLang handles itself there, passes both."""
    from sglang_patches.fixes.weight_update_pause import FIX, FLUSH
    from sglang_patches.registry import VARIANTS, table

    port = table(next(v for v in VARIANTS if v.name == variant).table)[FIX.name]
    hooked = {h.target for h in port.hooks}
    needles = {"weight_pause_empty_body_keeps_requests": ABORTED, "weight_version_publish_keeps_requests": ABORTED,
               "weight_pause_flush_with_retracted_waiting": FLUSH_REFUSED if FLUSH in hooked else None}
    return {name: (needles.get(name) if KIND[name] == "defect" else None, True) for name in SCENARIOS}


if __name__ == "__main__":
    main(SCENARIOS, sys.argv[1])
