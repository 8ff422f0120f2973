"""A retracted request's re-prefill routes its kept positions with the kept rows.

Defect: after a retraction SGLang re-prefills the request's prefix, and its MoE routers choose again, in
prefill numerics (and after a weight update with the new weights). Near router ties they choose other
experts than the ones the tokens were sampled with. The tokens sampled after the re-prefill attend to that
prefix, so no row set the trainer can replay reproduces both: the kept rows (`retraction-rows`) describe the
tokens before the retraction, the re-prefill's rows the tokens after it. Measured on the near-tie model: the
tokens after a retraction replayed 2.5x the unretracted mismatch with the kept rows.

Fix (two surgical wrappers; only requests whose rows `retraction-rows` kept are touched):
- AROUND `Scheduler.run_batch`: for an extend batch, the batch rows of every request's positions that have
  kept rows form the forward's plan (row index -> kept experts per layer); the plan lives while the batch runs.
- AROUND `topk._post_process_topk_ids` (every router's ids pass it before SGLang captures them and maps them
  to physical experts): the planned rows take the kept experts; their weights are the router's own formula
  (sigmoid with a correction bias, else softmax; renormalized when the config says) at those experts, scaled
  as SGLang scaled the ids it chose, which is checked on the same rows first: where the formula does not
  reproduce SGLang's weights the layer keeps SGLang's choice (logged once).

So the re-prefill's KV is the one the returned rows describe, and the captured rows of those positions are the
kept ones. Draft-model routers (no capture) are left alone.

Not forced, one log line per process each (the kept rows are still returned, `retraction-rows`): under DP
attention (the routers run on tokens gathered from every DP rank, and each rank knows only its own requests'
rows), with an all-to-all MoE backend (the tokens are split across ranks), and where no router passed the
post-processing while a plan was set (a CUDA-graphed prefill, a fused router that skips it).
"""
import logging

from sglang_patches.fixes.retraction_rows import KEPT
from sglang_patches.registry import Fix, Hook

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
POST_PROCESS = "sglang.srt.layers.moe.topk._post_process_topk_ids"

logger = logging.getLogger("slime_moe_rollout")
_plan = None        # (batch rows LongTensor, kept experts int32 [rows, layers, topk]) of the batch running
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


def _batch_plan(server_args, batch):
    if batch is None or not batch.forward_mode.is_extend() or not any(getattr(r, KEPT, None) for r in batch.reqs):
        return None
    if getattr(server_args, "enable_dp_attention", False):
        _once("dp", NOT_FORCED, "DP attention (each rank knows only its own requests' kept rows)")
    elif getattr(server_args, "moe_a2a_backend", None) not in (None, "none"):
        _once("a2a", NOT_FORCED, "an all-to-all MoE backend splits the tokens across ranks")
    elif not len(batch.reqs) == len(batch.prefix_lens) == len(batch.extend_lens):
        _once("lens", NOT_FORCED, "the batch's prefix and extend lengths do not match its requests")
    else:
        return plan_of(batch.reqs, batch.prefix_lens, batch.extend_lens)
    return None


def plan_on_run_batch(original, self, batch, *args, **kwargs):
    """AROUND Scheduler.run_batch: the batch's plan while it runs."""
    global _plan, _used
    _plan, _used = _batch_plan(self.server_args, batch), False
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        if _plan is not None and not _used:
            _once("unused", NOT_FORCED, "no router passed select_experts' post-processing (a CUDA-graphed "
                                        "prefill or a fused router)")
        _plan = None


def force_on_post_process(original, *args, **kwargs):
    """AROUND topk._post_process_topk_ids: the planned rows take the kept experts."""
    global _plan, _used
    if _plan is None:   # every forward without a retracted request's re-prefill
        return original(*args, **kwargs)
    plan, layer, cfg = _plan, kwargs.get("layer_id"), kwargs.get("topk_config")
    if layer is None or cfg is None or not getattr(cfg, "allow_routed_experts_capture", True):
        return original(*args, **kwargs)
    rows, kept = plan
    if layer >= kept.shape[1]:
        return original(*args, **kwargs)
    _used = True
    ids, weights = kwargs["topk_ids"], kwargs["topk_weights"]
    if rows.device != ids.device:   # once per batch, not once per layer
        rows, kept = _plan = rows.to(ids.device), kept.to(ids.device)
    experts = kept[:, layer, :].to(ids.dtype)
    new = kept_weights(cfg, kwargs["router_logits"], rows, ids, weights, experts)
    if new is None:
        _once("formula", NOT_FORCED, f"layer {layer}'s router weights are not sigmoid/softmax of its logits")
        return original(*args, **kwargs)
    ids, weights = ids.clone(), weights.clone()
    ids[rows, :experts.shape[1]] = experts
    weights[rows, :experts.shape[1]] = new
    kwargs["topk_ids"], kwargs["topk_weights"] = ids, weights
    return original(*args, **kwargs)


PLAN = Hook(RUN_BATCH, plan_on_run_batch)
FORCE = Hook(POST_PROCESS, force_on_post_process)

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
