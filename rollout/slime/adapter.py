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

import asyncio
import importlib
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from rollout.routed_experts import decode_compact, slime_compact, to_slime_shape
from rollout.slime import attach, flags
from rollout.slime.types import RolloutFnTrainOutput, Sample
from rollout.types import Sample as ManagerSample
from rollout.types import SampleStatus

__all__ = ["generate", "generate_rollout", "reset", "set_backend", "set_tokenizer"]

_UNSET = object()


@dataclass
class _State:
    """What the adapter keeps between slime's calls in this process."""

    backend: Any = None       # a RolloutManager (attached to slime's workers, or given by set_backend)
    tokenizer: Any = _UNSET   # None: every prompt arrives as tokens; unset: slime's hf_checkpoint's
    pending: dict = field(default_factory=dict)   # manager group id -> slime samples (carried too)
    loop: Optional[attach.Loop] = None            # kept across reset(): the backend's event loop thread
    sample_ids: Iterator[int] = field(default_factory=itertools.count)   # unique in this process

    def reset(self) -> None:
        """Stop the backend (closing its HTTP session) and forget it, with its carried groups and the tokenizer."""
        backend, self.backend = self.backend, None
        if backend is not None and self.loop is not None:
            backend.drop_carried()
            self.loop.run(backend.stop())
        self.tokenizer, self.pending = _UNSET, {}


_STATE = _State()
_LOCK = threading.Lock()
_SLIME = {  # slime's own rollout helpers (importable wherever slime calls this adapter)
    "eval": "slime.rollout.sglang_rollout.generate_rollout",
    "hooks": "slime.rollout.sample_hooks.apply_rollout_sample_hooks",
    "async_rm": "slime.rollout.rm_hub.async_rm",
    "batched_async_rm": "slime.rollout.rm_hub.batched_async_rm",
    "call_dynamic_filter": "slime.rollout.filter_hub.base_types.call_dynamic_filter",
    "should_drop": "slime.rollout.filter_hub.base_types.should_drop_dynamic_filter_output",
    "MetricGatherer": "slime.rollout.filter_hub.base_types.MetricGatherer",
    "loop": "slime.utils.async_utils.get_async_loop",
}
DROP_FAILED_ENV = "SLIME_MOE_ROLLOUT_DROP_FAILED"   # 1: drop groups with a FAILED sample (counted), else raise


def _load(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _slime(name: str, why: str):
    try:
        return _load(_SLIME[name])
    except ImportError as e:
        raise RuntimeError(f"{why} needs slime importable ({e})") from None


def _loop() -> attach.Loop:
    """slime's own loop thread (`slime.utils.async_utils`) where slime is importable, so rewards and their
    loop-bound clients (remote_rm's session) share one loop with slime's eval; else one of ours."""
    with _LOCK:
        if _STATE.loop is None:
            try:
                _STATE.loop = attach.Loop(_load(_SLIME["loop"])().loop)
            except ImportError:
                _STATE.loop = attach.Loop()
        return _STATE.loop


# ------------------------------------------------------------------ wiring
def set_backend(backend, tokenizer=None) -> None:
    """Use `backend` (a `RolloutManager`, attached or started) for every later call."""
    _STATE.backend, _STATE.tokenizer = backend, tokenizer


def set_tokenizer(tokenizer) -> None:
    """The tokenizer for prompts without tokens (None: every prompt arrives as tokens)."""
    _STATE.tokenizer = tokenizer


def reset() -> None:
    """Stop the backend (closing its HTTP session) and forget it, with its carried groups (the next call
    attaches again)."""
    _STATE.reset()


def _ensure(args):
    if _STATE.backend is None:
        tokenizer = _load_tokenizer(args) if _STATE.tokenizer is _UNSET else _STATE.tokenizer
        set_backend(_loop().run(attach.attach_workers(args)), tokenizer)
    return _STATE.backend, _STATE.tokenizer


def _load_tokenizer(args):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)


# ------------------------------------------------------------------ conversion
def _prompt_ids(sample, tokenizer) -> list:
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


# ------------------------------------------------------------------ hooks and rewards (slime's own)
async def _hooks(args, sample):
    if not getattr(args, "rollout_sample_hook_path", None):
        return sample
    return await _slime("hooks", "--rollout-sample-hook-path")(args, sample, evaluation=False)


async def _call_rm(args, name: str, value):
    return await _slime(name, "reward")(args, value)


async def _finish_group(args, group: list) -> list:
    """What slime's generate_and_rm / generate_and_rm_group do after generation: per sample, concurrently (slime
    runs one task per sample), its hooks then its reward (`batched_async_rm` over a custom generate function's
    `list[Sample]`; none for ABORTED); with `--group-rm`, `batched_async_rm` once over the group."""
    async def one(s):
        s = await _hooks(args, s)
        if getattr(args, "group_rm", False):
            return s
        if isinstance(s, list):
            if not any(x.status == x.Status.ABORTED for x in s):
                need = [x for x in s if x.reward is None]
                for x, r in zip(need, await _call_rm(args, "batched_async_rm", need)):
                    x.reward = r
        elif s.status != Sample.Status.ABORTED and s.reward is None:
            s.reward = await _call_rm(args, "async_rm", s)
        return s
    group = list(await asyncio.gather(*(one(s) for s in group)))
    if getattr(args, "group_rm", False):
        for s, r in zip(group, await _call_rm(args, "batched_async_rm", group)):
            s.reward = r
    return group


def on_one_rank(samples) -> bool:
    """Whether every attempt of these manager samples ran on one placed (engine, DP rank)."""
    seats = {(e, s.dp_rank) for s in samples for e in s.engines}
    return len(seats) == 1 and next(iter(seats))[1] is not None


def _drop_failed(args) -> bool:
    return bool(getattr(args, "slime_moe_rollout_drop_failed", False)) or os.environ.get(DROP_FAILED_ENV) == "1"


def _failure(dst: Sample, src: ManagerSample) -> str:
    return (f"sample index {dst.index} (group {dst.group_index}) failed on engine {src.engine}: {src.error} "
            f"(set {DROP_FAILED_ENV}=1 to drop such groups instead, counted as rollout/failed_groups)")


class _Filter:
    """slime's dynamic sampling filter and its drop metrics (no filter, no slime needed)."""

    def __init__(self, args):
        path = getattr(args, "dynamic_sampling_filter_path", None)
        self.fn = _load(path) if path else None
        self.gatherer = _slime("MetricGatherer", "--dynamic-sampling-filter-path")() if path else None

    def drop(self, args, group, remaining: int, target: int) -> bool:
        if self.fn is None:
            return False
        out = _slime("call_dynamic_filter", "filter")(self.fn, args, group)
        if _slime("should_drop", "filter")(out, remaining_batch_size=remaining, target_data_size=target):
            self.gatherer.on_dynamic_filter_drop(reason=out.reason)
            return True
        return False

    def metrics(self) -> dict:
        return self.gatherer.collect() if self.gatherer else {}


# ------------------------------------------------------------------ slime entry points
class _Sink:
    """Receives finished manager groups, turns them into slime groups, applies slime's per-group steps."""

    def __init__(self, args, pending: dict, layout, target: int):
        self.args, self.pending, self.layout, self.target = args, pending, layout, target
        self.seated = 0    # groups past the seat check, still in their hooks / reward / filter
        self.changed: Optional[asyncio.Condition] = None
        self.failed_groups = 0
        self.groups: list = []
        self.all_groups: list = []
        self.seen: set = set()
        self.filter = _Filter(args)
        self.started = 0   # slime's remaining_batch_size: groups submitted minus groups dropped
        self.on_one_rank = 0   # kept groups whose every attempt ran on one placed (engine, DP rank)

    async def put(self, group) -> bool:
        if group.group_id in self.seen:
            return False
        self.seen.add(group.group_id)
        slime_group = self.pending.pop(group.group_id)
        self.changed = self.changed or asyncio.Condition()
        async with self.changed:   # a seat is taken before any await: never more than `target` groups
            while len(self.groups) + self.seated >= self.target:
                if len(self.groups) >= self.target:   # batch already full: slime drops such a group too
                    return False
                await self.changed.wait()   # a seated group may still be filtered out
            self.seated += 1
        try:
            kept = await self._finish(group, slime_group)
        finally:
            async with self.changed:
                self.seated -= 1
                self.changed.notify_all()
        if not kept:
            return False
        self.on_one_rank += on_one_rank(group.samples)
        return True

    async def _finish(self, group, slime_group) -> bool:
        for dst, src in zip(slime_group, group.samples):
            fill_sample(self.args, dst, src, self.layout)
        failed = [(d, s) for d, s in zip(slime_group, group.samples) if s.status is SampleStatus.FAILED]
        if failed:
            if not _drop_failed(self.args):
                raise RuntimeError(_failure(*failed[0]))
            self.failed_groups += 1
            self.started -= 1
            return False
        slime_group = await _finish_group(self.args, slime_group)
        self.all_groups.append(slime_group)
        if self.filter.drop(self.args, slime_group, self.started, self.target):
            self.started -= 1
            return False
        self.groups.append(slime_group)
        return True


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime `--rollout-function-path` (and, by slime's default, `--eval-function-path`) entry point."""
    flags.refuse(args)   # a slime flag plugin mode cannot apply, set away from slime's default: one line
    if evaluation:
        return _slime("eval", "evaluation=True (slime's eval rollout)")(args, rollout_id, data_source,
                                                                       evaluation=True)
    if getattr(args, "custom_generate_function_path", None) not in (None, "rollout.slime.generate"):
        from rollout.slime import custom   # the user's function per sample, its requests through the manager
        return custom.generate_rollout(args, data_source)
    _refuse(args)
    backend, tokenizer = _ensure(args)
    n, want = int(args.n_samples_per_prompt), int(args.rollout_batch_size)
    if backend.n_samples != n:
        raise ValueError(f"backend generates {backend.n_samples} samples per prompt, slime asks for {n}")
    pending = _STATE.pending
    over = int(getattr(args, "over_sampling_batch_size", None) or want)
    sink = _Sink(args, pending, backend.layout, want)
    results = []

    def admit(slime_groups: list) -> list:   # manager groups for slime's; `pending` pairs them
        _refuse_multimodal(slime_groups)
        groups = [_manager_group(backend, g, tokenizer) for g in slime_groups]
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
        results.append(_loop().run(_step(backend, groups, sink, want - len(sink.groups), refill)))
        if not new_groups and not carried:
            break
    recycled = _recycle(args, backend, rollout_id, data_source)
    out = _output(args, backend, sink, results, data_source)
    out.metrics["rollout/recycled_groups"] = recycled
    return out


def _manager_group(backend, slime_group: list, tokenizer):
    """A manager group for a slime group; a group back from slime's buffer (partial rollout) keeps each
    sample's response so far (tokens, logprobs, routed experts, status) and is continued from there."""
    first = slime_group[0]
    ids = _prompt_ids(first, tokenizer)
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


def _recycle(args, backend, rollout_id, data_source) -> int:
    """slime's partial rollout: the step's unfinished groups, with their tokens so far, go back through
    `data_source.add_samples` (slime's buffer: `--buffer-filter-path` picks them next), `start_rollout_id` set
    on samples with a response. Without `--partial-rollout` the manager keeps the prompts (run again)."""
    if not getattr(args, "partial_rollout", False) or not backend.carried or not hasattr(data_source, "add_samples"):
        return 0   # a data source without slime's add_samples (not slime's): the manager keeps them, run first
    groups = []
    for g in backend.drop_carried():
        slime_group = _STATE.pending.pop(g.group_id)
        for dst, src in zip(slime_group, g.samples):
            fill_sample(args, dst, src, backend.layout)
            if dst.response and "start_rollout_id" not in (dst.metadata or {}):
                dst.metadata = dict(dst.metadata or {}, start_rollout_id=rollout_id)
        groups.append(slime_group)
    data_source.add_samples(groups)
    return len(groups)


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
        _load(args.rollout_sample_filter_path)(args, data)
    if getattr(args, "rollout_all_samples_process_path", None):
        _load(args.rollout_all_samples_process_path)(args, all_groups, data_source)
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
    backend, tokenizer = _ensure(args)
    ids = _prompt_ids(sample, tokenizer)
    cut = len(ids) - sample.response_length if sample.tokens else len(ids)
    k = next(_STATE.sample_ids)
    ms = ManagerSample(f"slime{k}/0", f"slime{k}", 0, ids[:cut], response_ids=ids[cut:],
                       logprobs=[0.0] * (len(ids) - cut), max_new_tokens=budget)
    if backend.layout is not None and sample.rollout_routed_experts is not None and len(ids) > 1:
        held = slime_compact.to_slime(sample.rollout_routed_experts, backend.layout)   # the rows slime holds
        ms.routed_experts = decode_compact(held, backend.layout, len(held) + 1)           # checked, then continued
    params = {key: v for key, v in sampling_params.items() if key != "max_new_tokens"}   # slime sent its own seed

    async def run():
        await backend.relist(max_age_s=5.0)
        return await backend.generate(ms, params)

    done = await _loop().run_async(run())
    return fill_sample(args, sample, done, backend.layout)
