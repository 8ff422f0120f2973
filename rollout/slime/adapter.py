"""slime plug-in points backed by the rollout manager (plugin mode).

    --rollout-function-path rollout.slime.generate_rollout
    --custom-generate-function-path rollout.slime.generate      (optional, per sample)

`generate_rollout(args, rollout_id, data_source, evaluation=False)` answers as slime's own
`slime.rollout.sglang_rollout.generate_rollout` does for everything slime's trainer reads, but runs the
groups through the manager (least-outstanding dispatch, stragglers aborted and carried, with their tokens,
to the next step). Per group, as slime does: the request slime sends (`attach.sampling_from_args`,
per-index seeds, budget `max_new_tokens - response_length`); every SGLang answer replayed through slime's
`Sample.append_response_tokens` (SGLang's text, logprobs, loss mask, top-p spans, weight versions, status);
`rollout_routed_experts` in slime's `[len(tokens)-1, num_layers, topk]` int32 (kept compact until the sample
is handed over: engines that advertise it send the compact wire format; with
`SLIME_MOE_ROLLOUT_COMPACT_TRAINER=1` compact until replay, `routed_experts.slime_compact`); slime's sample hooks, then
`async_rm` per sample, or `batched_async_rm` on the group with `--group-rm`; slime's dynamic filter with
its drop metrics; groups sorted by `index`; then slime's sample filter and all-samples process.
`Sample.rollout_id` is left as the data source gave it (slime: one id per rollout *execution*).
`evaluation=True` runs slime's own eval rollout (slime's default `--eval-function-path` is the rollout
function) and returns its `RolloutFnEvalOutput`.
`generate(args, sample, sampling_params, evaluation=False)` is slime's custom-generate contract for one
sample; slime itself then applies its hooks and reward.

The backend is a `RolloutManager` attached to the workers registered with slime's router
(`attach.attach_workers`: the router only says who they are; they are re-listed every step, so engines
slime restarts or removes are followed); `set_backend()` uses another manager instead. Only the manager's
public calls are used: `new_group`, `rollout`, `carried`, `relist`, `generate`, `set_weight_version`.
"""
from __future__ import annotations

from rollout.routed_experts import decode_compact, slime_compact
from rollout.slime import flags
from rollout.slime.convert import fill_sample, prompt_ids
from rollout.slime.partial import manager_group, recycle
from rollout.slime.sink import Sink
from rollout.slime.state import STATE, ensure, load, loop, reset, set_backend, set_tokenizer, slime_helper
from rollout.slime.types import RolloutFnTrainOutput, Sample
from rollout.types import Sample as ManagerSample

__all__ = ["generate", "generate_rollout", "reset", "set_backend", "set_tokenizer"]


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime `--rollout-function-path` (and, by slime's default, `--eval-function-path`) entry point."""
    flags.refuse(args)   # a slime flag plugin mode cannot apply, set away from slime's default: one line
    if evaluation:
        return slime_helper("eval", "evaluation=True (slime's eval rollout)")(args, rollout_id, data_source,
                                                                       evaluation=True)
    if getattr(args, "custom_generate_function_path", None) not in (None, "rollout.slime.generate"):
        from rollout.slime import custom   # the user's function per sample, its requests through the manager
        return custom.generate_rollout(args, data_source)
    _refuse(args)
    backend, tokenizer = ensure(args)
    n, want = int(args.n_samples_per_prompt), int(args.rollout_batch_size)
    if backend.n_samples != n:
        raise ValueError(f"backend generates {backend.n_samples} samples per prompt, slime asks for {n}")
    pending = STATE.pending
    over = int(getattr(args, "over_sampling_batch_size", None) or want)
    sink = Sink(args, pending, backend.layout, want)
    results = []

    def admit(slime_groups: list) -> list:   # manager groups for slime's; `pending` pairs them
        _refuse_multimodal(slime_groups)
        groups = [manager_group(backend, g, tokenizer) for g in slime_groups]
        pending.update((g.group_id, slime_group) for g, slime_group in zip(groups, slime_groups))
        return groups

    def refill() -> list:   # slime: while remaining_batch_size < target, submit over_sampling_batch_size more
        out = []
        while sink.started < want:
            got = data_source.get_samples(over)
            if not got:
                break
            out += admit(got)
            sink.started += len(got)
        return out
    while len(sink.groups) < want:
        carried = len(backend.carried)
        new_groups: list = []
        while len(sink.groups) + carried + len(new_groups) < want:   # slime: over_sampling_batch_size a time
            got = data_source.get_samples(over)
            if not got:
                break
            new_groups += got
        sink.started = len(sink.groups) + carried + len(new_groups)
        groups = admit(new_groups)
        results.append(loop().run(_step(backend, groups, sink, want - len(sink.groups), refill)))
        if not new_groups and not carried:
            break
    recycled = recycle(args, backend, rollout_id, data_source)
    out = _output(args, backend, sink, results, data_source)
    out.metrics["rollout/recycled_groups"] = recycled
    return out


DEFAULT_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"


def _refuse(args) -> None:
    """What slime's generate_rollout asserts, as one line."""
    if not getattr(args, "rollout_global_dataset", True) and \
            getattr(args, "data_source_path", None) in (None, DEFAULT_SOURCE):
        raise ValueError("--disable-rollout-global-dataset with slime's default data source gives empty prompts "
                         "(slime's generate_rollout asserts rollout_global_dataset): give --data-source-path or "
                         "drop the flag")


def _refuse_multimodal(groups) -> None:
    for g in groups:
        for s in g:
            mm = getattr(s, "multimodal_inputs", None) or {}
            if any(v is not None for v in mm.values()):
                raise ValueError(f"sample index {s.index} has multimodal inputs ({', '.join(sorted(mm))}): plugin "
                                 "mode sends tokens only; use slime's own rollout function for multimodal prompts")


async def _step(backend, groups, sink, need, refill=None):
    await backend.relist()   # the workers slime's router lists now (engines slime restarted, added or removed)
    return await backend.rollout(groups, sink, batch_size=need, refill=refill)


def _output(args, backend, sink, results, data_source) -> RolloutFnTrainOutput:
    """slime's last steps (groups by index, sample filter, all-samples process) and the step's metrics."""
    data = sorted(sink.groups, key=lambda g: g[0].index if g[0].index is not None else 0)
    all_groups = sorted(sink.all_groups, key=lambda g: g[0].index if g[0].index is not None else 0)
    if getattr(args, "rollout_sample_filter_path", None):
        load(args.rollout_sample_filter_path)(args, data)
    if getattr(args, "rollout_all_samples_process_path", None):
        load(args.rollout_all_samples_process_path)(args, all_groups, data_source)
    versions = [s.weight_versions[-1] for g in data for s in g if s.weight_versions]
    if versions:   # the version the engines serve now: what a restarted engine must match
        backend.set_weight_version(versions[-1])
    metrics = dict(sink.filter.metrics())
    metrics.update({"rollout/groups": len(data), "rollout/carried": results[-1].carried if results else 0,
                    "rollout/resent": sum(r.resent for r in results),
                    "rollout/first_group_s": results[0].first_group_s if results else None,
                    "rollout/wall_s": sum(r.wall_s for r in results),
                    "rollout/compact_routed_engines": sum(f.endswith(": compact")
                                                              for f in getattr(backend, "routed_formats", {}).values()),
                    "rollout/groups_on_one_rank": sink.on_one_rank, "rollout/failed_groups": sink.failed_groups})
    return RolloutFnTrainOutput(samples=data, metrics=metrics)


async def generate(args, sample, sampling_params, evaluation=False):
    """slime `--custom-generate-function-path` entry point: one sample through the manager.
    `sampling_params["max_new_tokens"]` is the total response budget (slime's rule)."""
    budget = int(sampling_params["max_new_tokens"])
    if budget < sample.response_length:
        raise ValueError(f"max_new_tokens {budget} < response_length {sample.response_length}")
    if budget == sample.response_length:
        sample.status = Sample.Status.TRUNCATED
        return sample
    backend, tokenizer = ensure(args)
    ids = prompt_ids(sample, tokenizer)
    cut = len(ids) - sample.response_length if sample.tokens else len(ids)
    k = next(STATE.sample_ids)
    ms = ManagerSample(f"slime{k}/0", f"slime{k}", 0, ids[:cut], response_ids=ids[cut:],
                       logprobs=[0.0] * (len(ids) - cut), max_new_tokens=budget)
    if backend.layout is not None and sample.rollout_routed_experts is not None and len(ids) > 1:
        held = slime_compact.to_slime(sample.rollout_routed_experts, backend.layout)   # the rows slime holds
        ms.routed_experts = decode_compact(held, backend.layout, len(held) + 1)           # checked, then continued
    params = {key: v for key, v in sampling_params.items() if key != "max_new_tokens"}   # slime sent its own seed

    async def run():
        await backend.relist(max_age_s=5.0)
        return await backend.generate(ms, params)

    done = await loop().run_async(run())
    return fill_sample(args, sample, done, backend.layout)
