"""What slime does with a finished group, on plugin mode's side: slime's sample hooks and rewards (concurrent per
sample, `--group-rm` once per group), its dynamic filter and metrics, FAILED samples raised in one line (or dropped
and counted), and the step's seats: never more than `rollout_batch_size` groups."""
from __future__ import annotations

import asyncio
import os
from typing import Optional

from rollout.slime.convert import fill_sample
from rollout.slime.state import load, slime_helper
from rollout.slime.types import Sample
from rollout.types import Sample as ManagerSample
from rollout.types import SampleStatus

DROP_FAILED_ENV = "SLIME_MOE_ROLLOUT_DROP_FAILED"   # 1: drop groups with a FAILED sample (counted), else raise


async def _hooks(args, sample):
    if not getattr(args, "rollout_sample_hook_path", None):
        return sample
    return await slime_helper("hooks", "--rollout-sample-hook-path")(args, sample, evaluation=False)


async def _call_rm(args, name: str, value):
    return await slime_helper(name, "reward")(args, value)


async def finish_group(args, group: list) -> list:
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


def failure_line(dst: Sample, src: ManagerSample, what: Optional[str] = None) -> str:
    what = what or f"sample index {dst.index} (group {dst.group_index})"
    return (f"{what} failed on engine {src.engine}: {src.error} "
            f"(set {DROP_FAILED_ENV}=1 to drop such groups instead, counted as rollout/failed_groups)")


class Filter:
    """slime's dynamic sampling filter and its drop metrics (no filter, no slime needed)."""

    def __init__(self, args):
        path = getattr(args, "dynamic_sampling_filter_path", None)
        self.fn = load(path) if path else None
        self.gatherer = slime_helper("MetricGatherer", "--dynamic-sampling-filter-path")() if path else None

    def drop(self, args, group, remaining: int, target: int) -> bool:
        if self.fn is None:
            return False
        out = slime_helper("call_dynamic_filter", "filter")(self.fn, args, group)
        if slime_helper("should_drop", "filter")(out, remaining_batch_size=remaining, target_data_size=target):
            self.gatherer.on_dynamic_filter_drop(reason=out.reason)
            return True
        return False

    def metrics(self) -> dict:
        return self.gatherer.collect() if self.gatherer else {}


class Sink:
    """Receives finished manager groups, turns them into slime groups, applies slime's per-group steps."""

    def __init__(self, args, pending: dict, layout, target: int):
        self.args, self.pending, self.layout, self.target = args, pending, layout, target
        self.seated = 0    # groups past the seat check, still in their hooks / reward / filter
        self.changed: Optional[asyncio.Condition] = None
        self.failed_groups = 0
        self.groups: list = []
        self.all_groups: list = []
        self.seen: set = set()
        self.filter = Filter(args)
        self.started = 0   # slime's remaining_batch_size: groups submitted minus groups dropped
        self.on_one_rank = 0   # kept groups whose every attempt ran on one placed (engine, DP rank)
        self.unseated: list = []   # finished groups that found the batch full (`partial.recycle` takes them)

    async def put(self, group) -> bool:
        if group.group_id in self.seen:
            return False
        self.seen.add(group.group_id)
        slime_group = self.pending.pop(group.group_id)
        self.changed = self.changed or asyncio.Condition()
        async with self.changed:   # a seat is taken before any await: never more than `target` groups
            while len(self.groups) + self.seated >= self.target:
                if len(self.groups) >= self.target:   # batch already full: slime's abort collects it
                    self.pending[group.group_id] = slime_group
                    self.unseated.append(group)
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

    def fill(self, group, slime_group) -> Optional[str]:
        """The manager group's answers into the slime group; the one line naming its first FAILED sample, or None."""
        for dst, src in zip(slime_group, group.samples):
            fill_sample(self.args, dst, src, self.layout)
        failed = [(d, s) for d, s in zip(slime_group, group.samples) if s.status is SampleStatus.FAILED]
        return failure_line(*failed[0]) if failed else None

    async def _finish(self, group, slime_group) -> bool:
        failure = self.fill(group, slime_group)
        if failure:
            if not _drop_failed(self.args):
                raise RuntimeError(failure)
            self.failed_groups += 1
            self.started -= 1
            return False
        slime_group[:] = await finish_group(self.args, slime_group)   # the same list: the caller's too
        self.all_groups.append(slime_group)
        if self.filter.drop(self.args, slime_group, self.started, self.target):
            self.started -= 1
            return False
        self.groups.append(slime_group)
        return True
