"""EAGLE draft-decode batches count their real tokens (sglang#40156).

Defect: `ForwardBatch.init_new` counts a batch's real tokens as `len(batch.input_ids)`, or 0 when
`input_ids` is None. A draft-decode batch has no input ids yet (the scheduler clears them after every
forward; `draft_forward` sets them step by step), so with expert parallelism (moe_ep_size > 1, where
the count is armed) every draft token counts as padding: `_mask_topk_ids_padded_region` masks all of
the draft MoE layer's top-k ids to -1 (GLM-4.5's NEXTN layer is MoE) and the dispatcher maps -1 to a
real expert. Target tokens and routed-expert capture are unaffected (capture runs before the mask);
draft quality, hence acceptance, is. Reached with the shipped GLM-4.5 config (ep 32, EAGLE 3/1/4)
whenever draft decode runs eagerly (a batch above the draft graph's sizes, graphs off, a DP step that
cannot replay).

Fix: an AFTER hook on `init_new`: a draft worker's decode batch without input ids counts
`batch_size * spec_info.num_tokens_per_req` tokens, the rule SGLang 0.5.23 applies itself
(`ForwardBatch._init_num_token_non_padded`). From 0.5.20 the count `init_new` sets is the global one
(`global_num_token_non_padded`; the local count is derived from it later): `COUNT_GLOBAL`.
"""
from sglang_patches.registry import Fix, Hook

INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def _draft_tokens(result, args, kwargs):
    """The real token count of a draft worker's decode batch without input ids, else None."""
    batch = args[1] if len(args) > 1 else kwargs["batch"]
    runner = args[2] if len(args) > 2 else kwargs["model_runner"]
    spec = result.spec_info
    if not (runner.is_draft_worker and batch.input_ids is None and spec is not None
            and result.forward_mode.is_decode()):
        return None
    return result.batch_size * spec.num_tokens_per_req


def _set_count(result, n, prefix):
    tensor = getattr(result, f"{prefix}num_token_non_padded")
    if tensor is not None:
        tensor.fill_(n)
    setattr(result, f"{prefix}num_token_non_padded_cpu", n)


def count_draft_tokens(result, *args, **kwargs):
    """AFTER ForwardBatch.init_new(cls, batch, model_runner): fix a draft-decode batch's token count."""
    n = _draft_tokens(result, args, kwargs)
    if n is not None:
        _set_count(result, n, "")
    return result


def count_draft_tokens_global(result, *args, **kwargs):
    """As `count_draft_tokens`, on the global count (`global_num_token_non_padded`, 0.5.20 to 0.5.22)."""
    n = _draft_tokens(result, args, kwargs)
    if n is not None:
        _set_count(result, n, "global_")
    return result


COUNT = Hook(INIT_NEW, count_draft_tokens, "after")  # up to 0.5.19
COUNT_GLOBAL = Hook(INIT_NEW, count_draft_tokens_global, "after")  # 0.5.20 to 0.5.22

FIX = Fix(
    name="draft-token-count",
    family="dp-attention",
    defect="sglang#40156: EAGLE draft-decode batches have no input ids at init_new, so num_token_non_padded is 0 "
           "and, with EP, the draft MoE layer's top-k ids are all masked to -1. Acceptance drops.",
    reference="sglang#40156 (open)",
    test="tests/test_version_matrix.py::test_fix_on_variant",
)
