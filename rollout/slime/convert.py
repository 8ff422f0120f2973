"""One manager sample into slime's `Sample`: the prompt's tokens by slime's rule, every SGLang answer replayed
through slime's own `append_response_tokens`, routed experts in slime's shape;
the weight version of every response token (`version_spans`, from rollout/versions.py)."""
from __future__ import annotations

from rollout.routed_experts import slime_compact, to_slime_shape
from rollout.slime.types import Sample
from rollout.types import Sample as ManagerSample
from rollout.types import SampleStatus
from rollout.versions import version_spans  # noqa: F401  (one builder: rollout/versions.py)


def prompt_ids(sample, tokenizer) -> list:
    """slime's rule: the sample's tokens when it has them, else `encode(prompt, add_special_tokens=False)`
    (slime's data source has already applied the chat template)."""
    if sample.tokens:
        return list(sample.tokens)
    if tokenizer is None:
        raise ValueError("sample has no tokens and no tokenizer is set")
    return list(tokenizer.encode(sample.prompt, add_special_tokens=False))


def fill_sample(args, dst: Sample, src: ManagerSample, layout=None) -> Sample:
    """Replay the manager sample's SGLang answers into slime's `Sample` through slime's own
    `append_response_tokens`, then set `rollout_routed_experts` (already merged) in slime's shape.
    The response `dst` already holds (a sample back from slime's buffer) is off-policy: with
    `--partial-rollout` and `--mask-offpolicy-in-partial-rollout` its loss mask is 0, as slime sets it."""
    off_policy = dst.response_length
    if not dst.tokens:
        dst.tokens = list(src.prompt_ids)
    pos = len(dst.tokens) - len(src.prompt_ids)          # response tokens slime already holds
    for n, text, meta in src.outputs:
        dst.append_response_tokens(args, tokens=src.response_ids[pos:pos + n], log_probs=src.logprobs[pos:pos + n],
                                   trainable=True, meta_info=meta, text=text)
        pos += n
    if off_policy and getattr(args, "partial_rollout", False) and getattr(args, "mask_offpolicy_in_partial_rollout",
                                                                           False):
        dst.loss_mask = [0] * off_policy + list(dst.loss_mask[off_policy:])
    if src.status is SampleStatus.TRUNCATED and not src.outputs:
        dst.status = Sample.Status.TRUNCATED               # budget already used up: no request
    elif src.status is SampleStatus.FAILED:
        dst.status = Sample.Status.FAILED
        dst.metadata = dict(dst.metadata or {}, slime_moe_rollout_error=src.error)
    if src.routed_experts is not None and layout is not None:
        if slime_compact.enabled() and slime_compact.install_rollout_side():   # compact until replay (opt-in)
            dst.rollout_routed_experts = slime_compact.for_slime(src.routed_experts)
        else:   # the one conversion, when the sample is handed to slime: compact until then
            dst.rollout_routed_experts = to_slime_shape(src.routed_experts, layout)
        src.routed_experts = None
    return dst


def flat(group) -> list:
    """A group's samples, a custom generate function's `list[Sample]` entries opened."""
    return [x for s in group for x in (s if isinstance(s, list) else [s])]


def refuse_multimodal(groups) -> None:
    for g in groups:
        for s in g:
            mm = getattr(s, "multimodal_inputs", None) or {}
            if any(v is not None for v in mm.values()):
                raise ValueError(f"sample index {s.index} has multimodal inputs ({', '.join(sorted(mm))}): plugin "
                                 "mode sends tokens only; use slime's own rollout function for multimodal prompts")
