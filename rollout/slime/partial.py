"""slime's partial rollout on plugin mode's side: a group back from slime's buffer is continued from the
response it holds; the step's unfinished groups go back through slime's `data_source.add_samples`."""
from __future__ import annotations

from rollout.routed_experts import decode_compact, slime_compact
from rollout.slime.convert import fill_sample, prompt_ids
from rollout.slime.state import STATE
from rollout.types import SampleStatus


def manager_group(backend, slime_group: list, tokenizer):
    """A manager group for a slime group; a group back from slime's buffer (partial rollout) keeps each
    sample's response so far (tokens, logprobs, routed experts, status) and is continued from there."""
    first = slime_group[0]
    ids = prompt_ids(first, tokenizer)
    group = backend.new_group(ids[:len(ids) - first.response_length] if first.tokens else ids)
    for ms, s in zip(group.samples, slime_group):
        r = s.response_length
        if not r:
            continue
        tokens = list(s.tokens)
        ms.prompt_ids, ms.response_ids = tokens[:-r], tokens[-r:]
        ms.logprobs = list(s.rollout_log_probs) if s.rollout_log_probs else [0.0] * r
        ms.status = getattr(SampleStatus, s.status.name, SampleStatus.PENDING)
        if backend.layout is not None and s.rollout_routed_experts is not None and len(tokens) > 1:
            held = slime_compact.to_slime(s.rollout_routed_experts, backend.layout)
            ms.routed_experts = decode_compact(held, backend.layout, len(held) + 1)
    return group


def recycle(args, backend, rollout_id, data_source, filled: bool = False, unseated=()) -> int:
    """slime's partial rollout: the step's unfinished groups, with their tokens so far, and the finished ones
    that found the batch full (`unseated`: slime's abort collects every pending group) go back through
    `data_source.add_samples` (slime's buffer: `--buffer-filter-path` picks them next), `start_rollout_id` set
    on samples with a response. Without `--partial-rollout` the manager keeps the unfinished prompts (run
    again) and the unseated groups are dropped, as slime drops them.
    `filled`: the slime samples already hold their response (a custom generate function's)."""
    if not getattr(args, "partial_rollout", False) or not hasattr(data_source, "add_samples") or \
            not (backend.carried or unseated):
        for g in unseated:
            STATE.pending.pop(g.group_id, None)
        return 0   # a data source without slime's add_samples (not slime's): the manager keeps them, run first
    groups = []
    for g in backend.drop_carried() + list(unseated):
        slime_group = STATE.pending.pop(g.group_id)
        for dst, src in zip(slime_group, g.samples):
            if not filled:
                fill_sample(args, dst, src, backend.layout)
            if isinstance(dst, list):   # a function's list[Sample] (slime's abort would not take it either)
                continue
            if dst.response and "start_rollout_id" not in (dst.metadata or {}):
                dst.metadata = dict(dst.metadata or {}, start_rollout_id=rollout_id)
        groups.append(slime_group)
    data_source.add_samples(groups)
    return len(groups)
