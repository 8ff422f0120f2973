"""A retracted request's re-prefill routes its kept positions with the kept rows.

Defect: after a retraction SGLang re-prefills the request's prefix, and its MoE routers choose again, in
prefill numerics (and after a weight update with the new weights). Near router ties they choose other
experts than the ones the tokens were sampled with. The tokens sampled after the re-prefill attend to that
prefix, so no row set the trainer can replay reproduces both: the kept rows (`retraction-rows`) describe the
tokens before the retraction, the re-prefill's rows the tokens after it. Measured on the near-tie model: the
tokens after a retraction replayed 2.5x the unretracted mismatch with the kept rows.

Fix (three surgical wrappers; only requests whose rows `retraction-rows` kept are touched):
- AROUND `Scheduler.run_batch`: for an extend batch, the batch rows of every request's positions that have
  kept rows form the forward's plan (row index -> kept experts per layer); the plan lives while the batch runs.
- AROUND `topk._post_process_topk_ids` (every router's ids pass it before SGLang captures them and maps them
  to physical experts): the planned rows take the kept experts; their weights are the router's own formula
  (sigmoid with a correction bias, else softmax; renormalized when the config says) at those experts, scaled
  as SGLang scaled the ids it chose, which is checked on the same rows first: where the formula does not
  reproduce SGLang's weights the layer keeps SGLang's choice (logged once).
- AFTER `release_req` (every retraction): a request whose rows were kept matches and inserts its prefix in a radix
  namespace of its own (``Req.extra_key`` prefixed with `OWN_KEY` and its rid). Otherwise its re-prefill reuses
  the prefix another request cached meanwhile (after a weight update: the same prompt prefilled under the new
  weights with that request's own routes), no plan forces those positions, and its later tokens attend to KV
  no returned row describes (measured on the near-tie model after a weight update: 384 of 500 kept token-layer
  rows routed elsewhere by the re-prefill). The cost: such a request re-prefills its whole prefix.

So the re-prefill's KV is the one the returned rows describe, and the captured rows of those positions are the
kept ones. Draft-model routers (no capture) are left alone.

Under DP attention the routers run on the tokens gathered from every DP rank, and each rank knows only its own
requests' kept rows: in an extend step (every rank runs it, idle ranks too) the ranks exchange their plans on
the scheduler's TP CPU group (only where the engine returns routed experts: a small gather of who holds a plan,
then one broadcast per DP slot that has one, its kept experts in one byte each where they fit), and each
router places DP slot d's rows after the earlier slots' token counts (`get_dp_global_num_tokens`, padded or
not), as SGLang's capturer slices them. So every rank forces the same rows.

Not forced, one log line per process each (the kept rows are still returned, `retraction-rows`): with an
all-to-all MoE backend (the tokens are split across ranks), a DP gather over the whole world (elastic
scale-up: the routers see every rank's rows and no plan is placed in them, this rank's own plan included),
routers whose rows do not match the DP gather, and where no router passed the post-processing while a plan
was set (a CUDA-graphed prefill, a fused router that skips it).

The hooks run inside SGLang's scheduler: a failure in their own code (never SGLang's) routes the batch as
SGLang chooses, with one log line, and never reaches the scheduler. Under DP attention a rank whose plan or
payload fails still joins the exchange with none (the other ranks would wait forever).
"""
import logging

from sglang_patches.fixes.retraction_rows import KEPT
from sglang_patches.registry import Fix, Hook

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
POST_PROCESS = "sglang.srt.layers.moe.topk._post_process_topk_ids"
RELEASE = "sglang.srt.managers.schedule_batch.release_req"
OWN_KEY = "slime-moe-rollout-kept"   # Req.extra_key prefix: a retracted request's own radix namespace

logger = logging.getLogger("slime_moe_rollout")
_plan = None        # (batch rows LongTensor, kept experts int32 [rows, layers, topk]) of the batch running
_dp_plans = None    # under DP attention: {DP slot: its plan}, placed in the gathered rows by the first router
_used = False       # a router took the plan during this batch
_said = set()       # log lines already written by this process


def _once(key: str, msg: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning(msg, *args)


# ---- the plan (pure) ----------------------------------------------------------------------------
def plan_of(reqs, prefix_lens, extend_lens):
    """(rows, kept experts) for the positions of an extend batch that have kept rows, or None. Request i's
    positions ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])`` follow the earlier requests' rows."""
    import torch

    rows, kept_rows, off = [], [], 0
    for req, pre, ext in zip(reqs, prefix_lens, extend_lens, strict=True):
        kept = getattr(req, KEPT, None)
        if kept is not None:
            first, experts = kept
            lo, hi = max(pre, first), min(pre + ext, first + experts.shape[0])
            if lo < hi:
                rows.append(torch.arange(off + lo - pre, off + hi - pre))
                kept_rows.append(experts[lo - first: hi - first])
        off += ext
    return (torch.cat(rows), torch.cat(kept_rows)) if rows else None


def kept_weights(topk_config, router_logits, rows, ids, weights, kept):
    """The router's weights at the kept experts of `rows`, or None where its formula (checked on the experts
    SGLang chose for the same rows) does not reproduce SGLang's weights up to one scale."""
    import torch

    k = kept.shape[1]
    sigmoid = getattr(topk_config, "correction_bias", None) is not None \
        or getattr(topk_config, "scoring_func", None) == "sigmoid"
    scores = router_logits[rows].float()
    scores = scores.sigmoid() if sigmoid else scores.softmax(-1)

    def formula(experts):
        w = scores.gather(1, experts.long())
        return w / w.sum(-1, keepdim=True) if topk_config.renormalize else w

    scale = weights[rows, :k].float() / formula(ids[rows, :k])
    if not torch.allclose(scale, scale.mean().expand_as(scale), rtol=2e-2):
        return None
    return (formula(kept) * scale.mean()).to(weights.dtype)


# ---- the hooks ----------------------------------------------------------------------------------
NOT_FORCED = "slime-moe-rollout retraction-routes: a retracted request's re-prefill routes as SGLang chooses: %s"
FORCED_DP = "slime-moe-rollout retraction-routes: DP slot %d routes the kept rows of DP slots %s in the gathered batch"


def _batch_plan(server_args, batch):
    if batch is None or not batch.forward_mode.is_extend() or not any(getattr(r, KEPT, None) for r in batch.reqs):
        return None
    if getattr(server_args, "moe_a2a_backend", None) not in (None, "none"):
        _once("a2a", NOT_FORCED, "an all-to-all MoE backend splits the tokens across ranks")
    elif not len(batch.reqs) == len(batch.prefix_lens) == len(batch.extend_lens):
        _once("lens", NOT_FORCED, "the batch's prefix and extend lengths do not match its requests")
    else:
        return plan_of(batch.reqs, batch.prefix_lens, batch.extend_lens)
    return None


# ---- DP attention: every rank's plan, placed in the gathered rows --------------------------------
def _dpa():
    import sglang.srt.layers.dp_attention as dpa

    return dpa


def own_slot() -> int:
    """This process's DP slot in the gather, as the release's capturer finds it."""
    dpa = _dpa()
    return (getattr(dpa, "dp_gather_slot", None) or dpa.get_attention_dp_rank)()


def _world_gather() -> bool:
    return getattr(_dpa(), "world_dp_gather_enabled", lambda: False)()


def _exchanges(server_args, batch) -> bool:
    """Whether this step exchanges plans: the same answer on every rank of the TP group."""
    if not (getattr(server_args, "enable_dp_attention", False)
            and getattr(server_args, "enable_return_routed_experts", False)
            and batch is not None and getattr(batch, "is_extend_in_batch", False)
            and getattr(server_args, "moe_a2a_backend", None) in (None, "none")):
        return False
    if _world_gather():
        _once("world", NOT_FORCED, "the DP gather spans the whole world (elastic scale-up)")
        return False
    return True


def step_plans(scheduler, batch):
    """(this batch's plan, every DP slot's plan) of a scheduler's step, at most one of them set. Under DP attention the
    routers see the rows gathered from every DP rank, so this rank's batch rows are never a plan there:
    the step forces only through the exchange, and routes as SGLang chooses where there is none."""
    server_args = scheduler.server_args
    if not getattr(server_args, "enable_dp_attention", False):
        return _batch_plan(server_args, batch), None
    if _exchanges(server_args, batch):
        return None, _dp_exchange(scheduler, batch)
    if batch is not None and getattr(batch, "reqs", None) and any(getattr(r, KEPT, None) for r in batch.reqs):
        if getattr(server_args, "moe_a2a_backend", None) not in (None, "none"):
            _once("a2a", NOT_FORCED, "an all-to-all MoE backend splits the tokens across ranks")
        elif _world_gather():
            _once("world", NOT_FORCED, "the DP gather spans the whole world (elastic scale-up)")
    return None, None


def narrow(kept):
    """Kept experts in the smallest integer type that holds them (GLM-4.5's 160 experts: one byte each)."""
    import torch

    lo, hi = int(kept.min()), int(kept.max())
    for dtype in (torch.uint8, torch.int16):
        if torch.iinfo(dtype).min <= lo and hi <= torch.iinfo(dtype).max:
            return kept.to(dtype)
    return kept


def exchange(group, slot, plan):
    """{DP slot: plan} of every slot with a plan, the same on every rank of `group`. A small gather says which
    ranks hold a plan; then the first such rank of each slot broadcasts it (the slot's other ranks hold
    the same plan), its kept experts narrowed."""
    import torch
    import torch.distributed as dist

    try:   # this rank's payload before any collective: a failure here joins with no plan
        payload = None if plan is None else (plan[0].to(torch.int32), narrow(plan[1]))
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        _failed("this rank's plan payload", e)
        plan = payload = None
    me, flags = dist.get_rank(group), torch.zeros(dist.get_world_size(group), 2, dtype=torch.int64)
    mine, root = torch.tensor([slot, int(plan is not None)]), dist.get_global_rank(group, 0)
    # a gather and a broadcast: on gloo an all-gather is a ring of world - 1 serial hops
    dist.gather(mine, list(flags.unbind(0)) if me == 0 else None, dst=root, group=group)
    dist.broadcast(flags, src=root, group=group)
    senders, plans = {}, {}
    for rank, (s, has) in enumerate(flags.tolist()):
        if has:
            senders.setdefault(s, rank)
    for s, src in sorted(senders.items()):
        box = [payload if src == me else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
        plans[s] = plan if src == me else (box[0][0].long(), box[0][1].to(torch.int32))
    return plans or None


def _dp_exchange(scheduler, batch):
    try:   # a rank that fails here still joins the exchange, or the others would wait forever
        mine = _batch_plan(scheduler.server_args, batch)
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        _failed("this rank's plan", e)
        mine = None
    return exchange(scheduler.tp_cpu_group, own_slot(), mine)


def gathered_plan(plans, counts, slot, rows_seen):
    """One plan in the routers' rows: slot d's rows follow the earlier slots' token counts. A gather of one
    entry (skipped) holds this slot's rows alone. None where the counts do not cover the routers' rows."""
    import torch

    if not counts or len(counts) == 1:
        plans, offsets = {0: plans[slot]} if slot in plans else {}, [0]
    else:
        offsets = [sum(counts[:d]) for d in range(len(counts))]
    if sum(counts or [rows_seen]) != rows_seen or any(d >= len(offsets) for d in plans):
        _once("layout", NOT_FORCED, f"the routers' {rows_seen} rows do not match the DP gather's counts {counts}")
        return None
    parts = [(rows + offsets[d], kept) for d, (rows, kept) in sorted(plans.items())]
    return (torch.cat([r for r, _ in parts]), torch.cat([k for _, k in parts])) if parts else None


FAILED = "slime-moe-rollout retraction-routes: %s failed (%s: %s); this batch routes as SGLang chooses"


def _failed(what: str, e: Exception) -> None:
    """Our own code failed inside SGLang's process: the batch routes as SGLang chooses, one line."""
    global _plan, _dp_plans
    _plan = _dp_plans = None
    logger.warning(FAILED, what, type(e).__name__, e)


def plan_on_run_batch(original, self, batch, *args, **kwargs):
    """AROUND Scheduler.run_batch: the batch's plan while it runs (under DP attention every rank's plan)."""
    global _plan, _dp_plans, _used
    _used = False
    try:
        _plan, _dp_plans = step_plans(self, batch)
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        _failed("the plan", e)
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        if (_plan is not None or _dp_plans is not None) and not _used:
            _once("unused", NOT_FORCED, "no router passed select_experts' post-processing (a CUDA-graphed "
                                        "prefill or a fused router)")
        _plan = _dp_plans = None


def _placed(router_logits):
    """The plan of this forward: under DP attention placed in the gathered rows once, by the first router."""
    global _plan, _dp_plans
    if _dp_plans is not None:
        slot, slots = own_slot(), sorted(_dp_plans)
        _plan = gathered_plan(_dp_plans, _dpa().get_dp_global_num_tokens(), slot, router_logits.shape[0])
        _dp_plans = None
        if _plan is not None:
            _once("dp", FORCED_DP, slot, slots)
    return _plan


def _forced(kwargs):
    """kwargs with the planned rows' ids and weights replaced, or None where this layer keeps SGLang's."""
    global _plan, _used
    layer, cfg = kwargs.get("layer_id"), kwargs.get("topk_config")
    if layer is None or cfg is None or not getattr(cfg, "allow_routed_experts_capture", True):
        return None
    _used = True
    plan = _placed(kwargs["router_logits"])
    if plan is None or layer >= plan[1].shape[1]:
        return None
    rows, kept = plan
    ids, weights = kwargs["topk_ids"], kwargs["topk_weights"]
    if rows.device != ids.device:   # once per batch, not once per layer
        rows, kept = _plan = rows.to(ids.device), kept.to(ids.device)
    experts = kept[:, layer, :].to(ids.dtype)
    new = kept_weights(cfg, kwargs["router_logits"], rows, ids, weights, experts)
    if new is None:
        _once("formula", NOT_FORCED, f"layer {layer}'s router weights are not sigmoid/softmax of its logits")
        return None
    ids, weights = ids.clone(), weights.clone()
    ids[rows, :experts.shape[1]] = experts
    weights[rows, :experts.shape[1]] = new
    return {**kwargs, "topk_ids": ids, "topk_weights": weights}


def force_on_post_process(original, *args, **kwargs):
    """AROUND topk._post_process_topk_ids: the planned rows take the kept experts."""
    if _plan is None and _dp_plans is None:   # every forward without a retracted request's re-prefill
        return original(*args, **kwargs)
    try:
        forced = _forced(kwargs)
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        _failed(f"forcing layer {kwargs.get('layer_id')}", e)
        forced = None
    return original(*args, **(forced or kwargs))


def own_prefix_on_release(result, *args, **kwargs):
    """AFTER release_req: a request that kept its rows re-prefills in a radix namespace of its own."""
    try:
        req = kwargs.get("req")
        if req is not None and getattr(req, KEPT, None) is not None:
            key = getattr(req, "extra_key", None) or ""
            if not key.startswith(OWN_KEY):   # SGLang appends its own parts (LoRA id last): ours goes first
                req.extra_key = f"{OWN_KEY}:{req.rid}|{key}" if key else f"{OWN_KEY}:{req.rid}"
    except Exception as e:  # noqa: BLE001 - never let our code stop SGLang's scheduler
        logger.warning("slime-moe-rollout retraction-routes: a retracted request's own prefix failed (%s: %s); "
                       "its re-prefill may reuse another request's cached prefix", type(e).__name__, e)
    return result


PLAN = Hook(RUN_BATCH, plan_on_run_batch)
FORCE = Hook(POST_PROCESS, force_on_post_process)
OWN_PREFIX = Hook(RELEASE, own_prefix_on_release, "after")

FIX = Fix(
    name="retraction-routes",
    family="r3",
    defect=(
        "A retracted request's re-prefill routes its prefix again; near router ties it picks other experts than "
        "its kept rows, so the tokens sampled after the retraction attend to a prefix no returned row set "
        "describes."
    ),
    reference="sglang#39633 (closed unmerged), sglang#24001, miles#3277",
    test="tests/test_retraction_rows.py::test_retraction_rows_on_variant",
)
