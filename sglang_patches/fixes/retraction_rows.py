"""A retracted request's routed experts keep the rows its tokens were sampled with.

Defect: on every reviewed release `release_req` frees a retracted request's KV slots and
`Req.reset_for_retract` drops its routed experts; the re-prefill recomputes the prefix into new slots, and
at finish `get_topk` reads every row through the current slots. The rows returned for the tokens generated
before the retraction are the re-prefill's routes (prefill numerics, and after a weight update the new
weights), not the routes that produced those tokens and their logprobs. Near router ties they differ.

Fix (three surgical wrappers):
- AROUND the module function `release_req` (every retraction goes through it: KV pressure,
  `pause_generation(mode="retract")`, priority preemption): before SGLang frees the slots, the rows of the
  positions already computed, ``[start_len, seqlen - 1)`` as `get_topk` reads them at finish, are copied
  onto the request (`KEPT`, bounded by its length). A later retraction keeps the earlier rows for their
  positions and adds the buffer's rows after them. A request that has sampled nothing yet (a chunked prefill
  retracted mid-prompt, whose later positions have no rows) keeps nothing.
- AROUND `_maybe_collect_routed_experts`: after SGLang's own collection, the kept rows replace the
  re-prefill's rows for their positions; rows after come from the buffer (sampling-time too: the
  re-prefill's last row and every decode/verify row after it produced the tokens that followed).
- AFTER the tokenizer manager's `_wait_one_response`: every answer carrying routed experts states the rule
  in ``meta_info[META_KEY]`` (`SAMPLING_TIME`, or `RECOMPUTED`), earned from the scheduler (below).

The stamp is earned: the tokenizer manager runs in another process than the scheduler that kept (or dropped)
the rows, so at finish the collect hook puts what the scheduler did (`evidence`) into the request's own
`Req.customized_info[EVIDENCE_KEY]`, a per-token list with the word at the last token. SGLang carries every
`customized_info` key to the tokenizer on every reviewed release (the streamer sends each chunk's slice,
BatchTokenIDOutput / BatchStrOutput carry it pickled, the tokenizer manager accumulates it into
``meta_info[key]``); the state hook reads it back and stamps from it: `SAMPLING_TIME` with
``meta_info[EVIDENCE_KEY] = {"rule", "retractions", "kept_rows"}`` when the scheduler kept the rows of every
retraction it saw (with ``"reprefill_differ"`` / ``"reprefill_compared"``: of the kept token-layer rows, those
whose re-prefill routed to another expert set, as SGLang collected them before the splice: 0 when
`retraction-routes` forced them), `RECOMPUTED` with ``{"rule", "why"}`` when a cap or a failure turned the fix
off, `RECOMPUTED` with ``{"rule", "asked": True}`` for a request that opted out. A retracted answer without the
scheduler's word (a scheduler without the fix) carries no stamp; an answer never retracted is `SAMPLING_TIME`
(SGLang's rows are the ones it was sampled with).

Bounded and guarded (the hooks run inside SGLang's scheduler and tokenizer manager): a request keeps at most
`PER_REQUEST_ENV` MB of rows and a scheduler process at most `PER_PROCESS_ENV` MB for all its requests (a
32k-token GLM-4.5 request keeps about 94 MB). A retraction past either cap, or a failure in a hook's own code,
turns the fix off for that request with one log line: its kept rows are dropped, `OFF` on the Req says why,
and its rows are SGLang's (recomputed). A failure never reaches SGLang's scheduler.

A request opts out per request with ``sampling_params.custom_params[RULE_KEY] = RECOMPUTED`` (SGLang's
rows). The request-owned copy dies with the request (aborts included). Under DP attention each rank's
scheduler reads its own capturer, as `get_topk` does. The compact wire feature compacts after the splice
(its AFTER hook wraps this one: the registry registers fixes before features).

Upstream: sglang#39633 (closed unmerged), sglang#24001 (open), miles#3277 (open).
"""
import logging
import os
import weakref

from sglang_patches.registry import Fix, Hook

RELEASE = "sglang.srt.managers.schedule_batch.release_req"
COLLECT = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor." \
          "_maybe_collect_routed_experts"
WAIT = "sglang.srt.managers.tokenizer_manager.TokenizerManager._wait_one_response"

KEPT = "_slime_moe_rollout_kept_rows"         # on the Req: (first position, int32 [rows, layers, topk])
META_KEY = "routed_experts_retraction"         # meta_info: which rows a retracted request's answer carries
RULE_KEY = "slime_moe_rollout.retraction_rows"  # sampling_params.custom_params: the per-request rule
SAMPLING_TIME = "sampling-time"
RECOMPUTED = "recomputed"
OFF = "_slime_moe_rollout_rows_off"           # on the Req: why its rows are SGLang's (a cap, a failure)
SEEN = "_slime_moe_rollout_retractions_seen"   # on the Req: retractions whose rows this fix kept
EVIDENCE_KEY = "routed_experts_retraction_evidence"  # customized_info -> meta_info: what the scheduler did
PER_REQUEST_ENV = "SLIME_MOE_ROLLOUT_KEPT_MB_PER_REQUEST"
PER_PROCESS_ENV = "SLIME_MOE_ROLLOUT_KEPT_MB_PER_PROCESS"
CAPS_MB = {PER_REQUEST_ENV: 512.0, PER_PROCESS_ENV: 4096.0}   # defaults

logger = logging.getLogger("slime_moe_rollout")
_holders = weakref.WeakValueDictionary()   # id -> live request of this process that holds kept rows
_warned = set()


# ---- the rows (pure) ----------------------------------------------------------------------------
def keep(prev, start: int, rows):
    """Rows kept so far (None or (first, tensor)) + the buffer's rows for ``[start, start + len(rows))``:
    positions already kept keep their rows, later ones come from `rows`."""
    import torch

    if prev is None:
        return start, rows
    first, kept = prev
    end = first + kept.shape[0]
    if start > end:  # never: the rows start at the same start_len each time
        raise ValueError(f"rows from {start} leave a gap after kept rows [{first}, {end})")
    return first, torch.cat([kept, rows[end - start:]]) if start + rows.shape[0] > end else kept


def splice(collected, start: int, kept) -> object:
    """SGLang's rows for ``[start, start + len(collected))`` with the kept rows over their positions."""
    first, rows = kept
    lo, hi = max(start, first), min(start + collected.shape[0], first + rows.shape[0])
    if lo >= hi:
        return collected
    out = collected.clone()
    out[lo - start: hi - start] = rows[lo - first: hi - first]
    return out


def disagree(collected, start: int, kept) -> tuple:
    """(token-layer rows where SGLang's collected rows route to another expert set than the kept rows, rows
    compared): how far the re-prefill's own routes are from the ones the tokens were sampled with."""
    first, rows = kept
    lo, hi = max(start, first), min(start + collected.shape[0], first + rows.shape[0])
    if lo >= hi:
        return 0, 0
    a = collected[lo - start: hi - start].sort(-1).values
    b = rows[lo - first: hi - first].to(a.dtype).sort(-1).values
    same = (a == b).all(-1)
    return int((~same).sum()), int(same.numel())


def _rule(custom_params) -> str:
    if isinstance(custom_params, dict) and custom_params.get(RULE_KEY) == RECOMPUTED:
        return RECOMPUTED
    return SAMPLING_TIME


def cap_bytes(env: str) -> int:
    """A cap in bytes from its environment variable (MB), the default where unset or not a number >= 0."""
    raw = os.environ.get(env)
    try:
        mb = float(raw) if raw else CAPS_MB[env]
        if not mb >= 0:
            raise ValueError(raw)
    except ValueError:
        if env not in _warned:
            _warned.add(env)
            logger.warning("slime-moe-rollout retraction-rows: %s=%r is not a size in MB; using %s", env, raw,
                           CAPS_MB[env])
        mb = CAPS_MB[env]
    return int(mb * (1 << 20))


def held_bytes(but=None) -> int:
    """Bytes of kept rows the live requests of this process hold (`but` excluded)."""
    kept = (getattr(r, KEPT, None) for r in list(_holders.values()) if r is not but)
    return sum(k[1].nbytes for k in kept if k is not None)


def _off(req, why: str) -> None:
    """The fix is off for this request: its kept rows dropped, its rows SGLang's; one log line."""
    if req is not None:
        setattr(req, KEPT, None)
        setattr(req, OFF, why)
        _holders.pop(id(req), None)
    logger.warning("slime-moe-rollout retraction-rows: request %s: %s; its routed experts are SGLang's "
                   "(recomputed)", getattr(req, "rid", None), why)


def _failed(req, what: str, e: Exception) -> None:
    _off(req, f"{what} failed ({type(e).__name__}: {e})")


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


# ---- the hooks ----------------------------------------------------------------------------------
def _keep_rows(req, req_pool_idx, req_to_token_pool):
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    if not getattr(req, "return_routed_experts", False):
        return
    if getattr(req, OFF, None) or _rule(getattr(req.sampling_params, "custom_params", None)) == RECOMPUTED:
        return
    if not req.output_ids:   # no token sampled yet (a chunked prefill retracted mid-prompt): nothing to keep
        setattr(req, SEEN, (getattr(req, SEEN, None) or 0) + 1)
        return
    capturer = get_global_experts_capturer()
    if capturer is None or req_pool_idx is None:
        _off(req, "its rows could not be read before the retraction (no capturer or no KV row)")
        return
    seqlen = len(req.origin_input_ids) + len(req.output_ids)
    start = min(req.routed_experts_start_len or 0, seqlen - 1)
    rows = capturer.get_topk(req_pool_idx=req_pool_idx, seqlen=seqlen, req_to_token_pool=req_to_token_pool,
                             start_len=start)
    kept = keep(getattr(req, KEPT, None), start, rows)
    size, per_request, per_process = kept[1].nbytes, cap_bytes(PER_REQUEST_ENV), cap_bytes(PER_PROCESS_ENV)
    held = held_bytes(but=req)
    if size > per_request or held + size > per_process:
        _off(req, f"its kept rows would take {_mb(size)} MB with {_mb(held)} MB held by this process's other "
                  f"requests (caps: {_mb(per_request)} MB a request, {_mb(per_process)} MB a process)")
        return
    setattr(req, KEPT, kept)
    setattr(req, SEEN, (getattr(req, SEEN, None) or 0) + 1)
    _holders[id(req)] = req


def evidence(req):
    """What this scheduler did with a finished request's rows (None: it never saw the request retracted)."""
    off = getattr(req, OFF, None)
    if off:
        return {"rule": RECOMPUTED, "why": str(off)}
    if _rule(getattr(req.sampling_params, "custom_params", None)) == RECOMPUTED:
        return None   # the tokenizer manager reads the rule from the request itself
    seen, kept = getattr(req, SEEN, None), getattr(req, KEPT, None)
    if not seen:
        return None
    return {"rule": SAMPLING_TIME, "retractions": int(seen), "kept_rows": 0 if kept is None else int(kept[1].shape[0])}


def send_evidence(req, word) -> None:
    """`word` to the tokenizer manager through SGLang's own channel: ``req.customized_info[EVIDENCE_KEY]``, one
    value per output token (the streamer sends each chunk's slice), the word at the last one."""
    n = len(req.output_ids_through_stop)
    if word is None or n == 0:
        return
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[EVIDENCE_KEY] = [None] * (n - 1) + [word]


def keep_on_release(original, *args, **kwargs):
    """AROUND release_req (0.5.19+: the request's pool row is `req.kv.req_pool_idx`)."""
    try:
        req = kwargs["req"]
        _keep_rows(req, getattr(getattr(req, "kv", None), "req_pool_idx", None), kwargs["req_to_token_pool"])
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        _failed(kwargs.get("req"), "keeping its rows", e)
    return original(*args, **kwargs)


def keep_on_release_req_idx(original, *args, **kwargs):
    """AROUND release_req (0.5.15.post1-0.5.18: the pool row is `req.req_pool_idx`)."""
    try:
        req = kwargs["req"]
        _keep_rows(req, getattr(req, "req_pool_idx", None), kwargs["req_to_token_pool"])
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        _failed(kwargs.get("req"), "keeping its rows", e)
    return original(*args, **kwargs)


def splice_on_collect(original, self, req, *args, **kwargs):
    """AROUND _maybe_collect_routed_experts: the kept rows over the re-prefill's rows."""
    out = original(self, req, *args, **kwargs)
    if getattr(req, "routed_experts", None) is None:
        return out
    word = None
    try:
        kept = getattr(req, KEPT, None)
        if kept is not None:
            seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
            start = min(req.routed_experts_start_len or 0, seqlen - 1)
            try:   # a measure only: its failure leaves the rows alone
                differ = disagree(req.routed_experts, start, kept)
            except Exception:  # noqa: BLE001
                differ = None
            req.routed_experts = splice(req.routed_experts, start, kept)
        word = evidence(req)
        if kept is not None and differ is not None and word is not None and word.get("rule") == SAMPLING_TIME:
            word["reprefill_differ"], word["reprefill_compared"] = differ
    except Exception as e:  # noqa: BLE001 - SGLang's rows stay
        _failed(req, "splicing its kept rows", e)
        word = {"rule": RECOMPUTED, "why": getattr(req, OFF, None) or "splicing failed"}
    finally:
        setattr(req, KEPT, None)
        _holders.pop(id(req), None)
    try:
        send_evidence(req, word)
    except Exception as e:  # noqa: BLE001 - the answer then carries no stamp (the client refuses it if it must)
        logger.warning("slime-moe-rollout retraction-rows: request %s: sending its evidence failed (%s: %s); its "
                       "answer is unstamped", getattr(req, "rid", None), type(e).__name__, e)
    return out


def state_rule(result, self, obj, *args, **kwargs):
    """AFTER the tokenizer manager's per-request response stream: answers with routed experts name the rule."""
    try:
        sp = getattr(obj, "sampling_params", None)
        rule = _rule(sp.get("custom_params") if isinstance(sp, dict) else None)
    except Exception as e:  # noqa: BLE001 - the answers pass unstamped
        logger.warning("slime-moe-rollout retraction-rows: request %s: reading its rule failed (%s: %s); its "
                       "answers are unstamped", getattr(obj, "rid", None), type(e).__name__, e)
        return result
    return _with_rule(result, rule, getattr(obj, "rid", None))


def stamp(meta: dict, rule: str) -> None:
    """The answer's stamp from the scheduler's word (`EVIDENCE_KEY`, as SGLang accumulated it), else from the
    request's rule for an opt-out or an answer never retracted; a retracted answer without a word: no stamp."""
    raw = meta.pop(EVIDENCE_KEY, None)
    word = next((w for w in reversed(raw) if isinstance(w, dict)), None) if isinstance(raw, list) else None
    if word is not None:
        meta[META_KEY], meta[EVIDENCE_KEY] = word.get("rule"), word
    elif rule == RECOMPUTED:
        meta[META_KEY], meta[EVIDENCE_KEY] = RECOMPUTED, {"rule": RECOMPUTED, "asked": True}
    elif not meta.get("num_retractions"):
        meta[META_KEY] = SAMPLING_TIME


async def _with_rule(gen, rule, rid=None):
    try:
        async for out in gen:
            try:
                meta = out.get("meta_info") if rule and isinstance(out, dict) else None
                if isinstance(meta, dict) and meta.get("routed_experts") is not None:
                    stamp(meta, rule)
            except Exception as e:  # noqa: BLE001 - this answer and the rest pass unstamped
                rule = None
                logger.warning("slime-moe-rollout retraction-rows: request %s: stamping its answer failed "
                               "(%s: %s); its answers are unstamped", rid, type(e).__name__, e)
            yield out
    finally:
        await gen.aclose()


KEEP = Hook(RELEASE, keep_on_release)
KEEP_REQ_IDX = Hook(RELEASE, keep_on_release_req_idx)
SPLICE = Hook(COLLECT, splice_on_collect)
STATE = Hook(WAIT, state_rule, "after")

FIX = Fix(
    name="retraction-rows",
    family="r3",
    defect=(
        "A retracted request's routed experts for the tokens generated before the retraction are the "
        "re-prefill's routes, not the ones those tokens were sampled with; near router ties they differ."
    ),
    reference="sglang#39633 (closed unmerged), sglang#24001, miles#3277",
    test="tests/test_retraction_rows.py::test_retraction_rows_on_variant",
)
