"""The rollout manager: dispatch samples to the engines a source admits, stream GRPO groups, carry the rest.

    async with RolloutManager.from_config(cfg, backend, model_path) as mgr:
        result = await mgr.rollout(prompts, sink, batch_size=N)    # groups reach `sink` as they finish

Which engines exist comes from an engine source (`engine_source`, the one factory): a managed fleet
(launch, readiness, health, restarts; `from_config`) or attached workers (engines started by someone
else, fixed or listed by a `discover` call such as slime's router). Every HTTP call goes through one
`EngineClient`. A source that gives every engine up closes the dispatcher: `rollout()` raises
`EnginesLost` at once, one line naming engines and causes.
Partial rollout: when `batch_size` groups are delivered, the remaining requests are aborted and
their groups kept, with tokens so far, for the next `rollout()` call (they are continued first).
Group ids are `<run_id>-g<n>` (`run_id` random unless given), unique across managers and runs;
`new_group(prompt, index=i)` fixes `n` (`run --resume` re-creates the same ids).
Groups start while the unfinished samples of started groups stay within twice the engines' slots
(`rollout/inflight.py`): a group's straggler does not hold the next group back.
One sample outside any group, with its own sampling params: `generate(sample, sampling)`. Unfinished
groups kept for the next step: `carried`, `drop_carried()`.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from rollout.config import engine_specs
from rollout.dispatch import Dispatcher
from rollout.engines.attached import AttachedWorkers
from rollout.engines.client import EngineClient
from rollout.engines.fleet import ManagedFleet
from rollout.engines.source import EngineSource
from rollout.errors import EnginesLost, WeightVersionError
from rollout.inflight import InFlight, bound
from rollout.placement import Placement
from rollout.routed_experts import MoELayout
from rollout.types import EngineEvent, Event, Group, Sample, SampleStatus, group_id
from rollout.versions import version_spans

__all__ = ["EnginesLost", "Event", "RolloutManager", "RolloutOptions", "RolloutResult", "WeightVersionError",
           "engine_source", "group_record"]


def engine_source(cfg=None, backend=None, model_path: Optional[str] = None, *, endpoints=(), discover=None,
                  empty_wait_s: float = 60.0, api_key=None, ports=None, **fleet) -> EngineSource:
    """The one factory. With a `backend`: a managed fleet of `cfg`'s engines serving `model_path` (`fleet`:
    `ManagedFleet` options: view, restart_view, weight_sync_hook, restarts, probe, max_events). Otherwise:
    attached workers, the fixed `endpoints` and/or what `discover` lists."""
    if backend is None:
        return AttachedWorkers(endpoints, discover, empty_wait_s)
    r = cfg.rollout
    return ManagedFleet(engine_specs(cfg, model_path, api_key=api_key, ports=ports), backend, r.budgets, r.health,
                        allow_unfixed=r.allow_unfixed, **fleet)


@dataclass(frozen=True)
class RolloutOptions:
    """What the rollout asks of every engine. `layout`: ask for, check and keep routed experts; `seeds`,
    `keep_answers`: see `Dispatcher`; `run_id`: the group-id prefix (random when None)."""
    sampling: dict
    n_samples: int
    concurrency: int                     # requests in flight per engine
    layout: Optional[MoELayout] = None
    seeds: Optional[list] = None
    keep_answers: bool = False
    partial_rollout: bool = True
    run_id: Optional[str] = None
    group_placement: str = "group"       # "group": each group on one (engine, DP rank), rollout/placement.py;
                                         # "sample": each sample to the least-outstanding engine

    @classmethod
    def from_config(cls, cfg, run_id: Optional[str] = None) -> "RolloutOptions":
        r = cfg.rollout
        sampling = {"temperature": r.sampling.temperature, "top_p": r.sampling.top_p,
                    "top_k": r.sampling.top_k, "max_new_tokens": r.sampling.max_new_tokens}
        layout = MoELayout.from_model(cfg.model) if any(g.routed_experts for g in cfg.engine_groups) else None
        return cls(sampling, r.n_samples_per_prompt, r.concurrency_per_engine, layout=layout,
                   partial_rollout=r.partial_rollout, run_id=run_id, group_placement=r.group_placement)


@dataclass
class RolloutResult:
    delivered: int = 0
    carried: int = 0                   # unfinished groups kept for the next step (partial rollout)
    failed_samples: int = 0            # in delivered groups
    failures: dict = field(default_factory=dict)     # error text -> samples that failed with it
    resent: int = 0
    unrouted_aborts: int = 0           # aborts that came back without routed experts (resumed later)
    first_group_s: Optional[float] = None
    wall_s: float = 0.0
    per_engine: dict = field(default_factory=dict)   # engine -> samples finished there


class RolloutManager:
    def __init__(self, source: EngineSource, options: RolloutOptions, client: Optional[EngineClient] = None):
        self.source, self.options = source, options
        self.client = client or EngineClient()
        self.dispatcher = Dispatcher(self.client, options.sampling, options.concurrency, layout=options.layout,
                                     seeds=options.seeds, keep_answers=options.keep_answers,
                                     on_error=source.on_error,
                                     placement=Placement(options.n_samples, options.concurrency)
                                     if options.group_placement == "group" else None)
        self.run_id = options.run_id or uuid.uuid4().hex[:10]
        self._gid = itertools.count()
        self.carry: list[Group] = []

    @classmethod
    def from_config(cls, cfg, backend, model_path: str, *, run_id: Optional[str] = None,
                    client: Optional[EngineClient] = None, **fleet) -> "RolloutManager":
        """A managed fleet of the config's engines (`fleet`: `engine_source` options: api_key, ports, view, ...)."""
        options = RolloutOptions.from_config(cfg, run_id)
        return cls(engine_source(cfg, backend, model_path, **fleet), options, client)

    @property
    def n_samples(self) -> int:
        return self.options.n_samples

    @property
    def layout(self) -> Optional[MoELayout]:
        return self.options.layout

    @property
    def routed_experts(self) -> bool:
        return self.options.layout is not None

    @property
    def routed_formats(self) -> dict:
        """engine -> "routed experts: compact" or ": int32 (why)", probed at each admission."""
        return self.dispatcher.routed_formats

    @property
    def events(self):
        return self.source.events.events

    def events_since(self, seq: int) -> list:
        """Events with seq >= `seq` still held (the oldest drop off after the log's bound)."""
        return self.source.events.since(seq)

    def count(self, kind: EngineEvent) -> int:
        return self.source.events.count(kind)

    # ------------------------------------------------------------------ start / stop
    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    async def start(self) -> "RolloutManager":
        """Admit the source's engines (a fleet starts them; attached workers are listed)."""
        try:
            await self.source.open(self.dispatcher)
        except BaseException:
            await self.client.close()
            raise
        return self

    async def stop(self) -> None:
        try:
            await self.source.close()
        finally:
            await self.client.close()

    async def relist(self, max_age_s: float = 0.0, wait_s: Optional[float] = None) -> None:
        """Follow engines that come and go (attached workers with `discover`; a no-op otherwise)."""
        await self.source.relist(max_age_s, wait_s)

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> Optional[str]:
        return self.source.weight_version

    def set_weight_version(self, version: str) -> None:
        """Call after every weight update: restarted engines must then report this version."""
        self.source.weight_version = str(version)

    async def update_weights_from_disk(self, model_path: str, version: str) -> list:
        """Load `model_path` into every admitted engine at once, their requests kept in flight
        (`EngineClient.update_weights`: retract-mode pause, flush, load, `version` published without aborting,
        continue), then expect `version` of restarted engines. Returns the engines' names; the first error
        is raised once every engine's update has ended (each is resumed whatever happened)."""
        engines = [slot.engine for slot in list(self.dispatcher.slots.values())]

        async def one(e):
            await self.client.update_weights(e, lambda: self.client.update_weights_from_disk(e, model_path, version),
                                             version, path="disk")
        errors = [r for r in await asyncio.gather(*(one(e) for e in engines), return_exceptions=True) if r]
        if errors:
            raise errors[0]
        self.set_weight_version(version)
        return [e.name for e in engines]

    # ------------------------------------------------------------------ rollout
    def new_group(self, prompt_ids, index: Optional[int] = None) -> Group:
        """A fresh group; `index` (e.g. the prompt's index, for `run --resume`) fixes its id."""
        return Group.fresh(group_id(self.run_id, next(self._gid) if index is None else index), prompt_ids,
                           self.n_samples)

    @property
    def carried(self) -> list:
        """Unfinished groups kept for the next `rollout()` call (run first there)."""
        return list(self.carry)

    def drop_carried(self) -> list:
        """Forget the unfinished groups (e.g. the trainer moved on); returns them."""
        dropped, self.carry = self.carry, []
        return dropped

    async def generate(self, sample: Sample, sampling: Optional[dict] = None) -> Sample:
        """Generate (or continue) one sample outside any group. `sampling`: params for this call only,
        laid over the manager's and sent as they are (no per-index seed is added)."""
        return await self.dispatcher.run(sample, None if sampling is None else {**self.options.sampling, **sampling})

    async def rollout(self, prompts, sink, batch_size: Optional[int] = None, on_group=None,
                      refill=None, run=None) -> RolloutResult:
        """Run groups (carried-over first, then one per prompt or `Group`) until `batch_size` are delivered
        to `sink`. `refill()`: called after each group the sink did not take, while the batch is not full;
        the groups it returns start at once, beside the ones still running (slime's over-sampling refill).
        `run(group)`: generates a group instead of the dispatcher's one request per sample (a caller whose
        requests reach `generate` another way: slime's custom generate functions); it leaves the statuses.

        With group placement and every group to be delivered, the fresh groups start longest first
        (`Dispatcher.longest_first`); with over-sampling they start as given (which ones finish first
        decides the batch, as in slime's rollout).

        Groups still running when the batch is full are aborted and kept for the next call, under the
        same ids (with partial_rollout with their tokens so far; otherwise started again from the prompt).
        """
        fresh = [p if isinstance(p, Group) else self.new_group(p) for p in prompts]
        total = len(self.carry) + len(fresh)
        batch_size = batch_size or total
        if batch_size >= total:   # every group is delivered: start them longest first
            fresh = self.dispatcher.longest_first(fresh)
        todo, self.carry = self.carry + fresh, []
        res = RolloutResult()
        t0 = time.monotonic()
        full = asyncio.Event()
        resent0, unrouted0 = self.dispatcher.resent, self.dispatcher.unrouted_aborts
        engines = max(1, self.source.planned, len(self.dispatcher.slots))
        gate = InFlight(bound(self.options.concurrency, engines, self.n_samples))
        leftovers: list[Group] = []

        async def run_group(group: Group, counted: int):
            async def one(s):
                nonlocal counted
                await self.dispatcher.run(s)
                if counted and not s.status.runnable:   # finished: the next group may start
                    counted -= 1
                    gate.leave(1)

            try:
                while True:
                    runs = [s for s in group.samples if s.status.runnable]
                    if not runs or full.is_set() or self.dispatcher.closed_reason:
                        break
                    for s in runs:
                        if s.status is SampleStatus.ABORTED:
                            s.resumes += 1
                    if self.dispatcher.placement is not None:   # every runnable sample will ask
                        self.dispatcher.placement.expect(group.group_id, len(runs))
                    await (run(group) if run else asyncio.gather(*(one(s) for s in runs)))
                unfinished = any(s.status.runnable for s in group.samples)
                if full.is_set() or self.dispatcher.closed_reason or unfinished:
                    leftovers.append(group)
                    return
                if not await sink.put(group):
                    if refill is not None and not full.is_set():
                        more.extend(refill())
                        wake.set()
                else:
                    res.delivered += 1
                    for s in group.samples:
                        if s.status is SampleStatus.FAILED:
                            res.failed_samples += 1
                            res.failures[s.error] = res.failures.get(s.error, 0) + 1
                    if res.first_group_s is None:
                        res.first_group_s = time.monotonic() - t0
                    if on_group:
                        on_group(group)
                    if res.delivered >= batch_size and not full.is_set():
                        full.set()
                        self.dispatcher.draining = True
                        if any(s.outstanding for s in self.dispatcher.slots.values()):
                            # stragglers return with their tokens so far
                            await self.dispatcher.abort(self.source.abort_to)
            finally:
                gate.leave(counted)

        tasks: list = []
        more: list = []        # refills, started by the loop below
        wake = asyncio.Event()

        async def start(groups):
            for group in groups:
                k = max(1, sum(s.status.runnable for s in group.samples))
                await gate.enter(k)
                if full.is_set():
                    gate.leave(k)
                    leftovers.append(group)
                    continue
                tasks.append(asyncio.create_task(run_group(group, k)))

        async def run_all():
            await start(todo)
            while True:
                running = [t for t in tasks if not t.done()]
                if more:
                    groups, more[:] = list(more), []
                    await start(groups)
                    continue
                if not running:
                    break
                wake.clear()
                waiter = asyncio.ensure_future(wake.wait())
                done, _ = await asyncio.wait([*running, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                for t in done:
                    if t is not waiter:
                        t.result()   # a sink that raised ends the step
            await asyncio.gather(*tasks)

        try:
            await run_all()
        except BaseException:   # a sink that raises ends the step: nothing keeps running behind it
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.dispatcher.draining = False
            raise
        self.dispatcher.draining = False
        if self.dispatcher.closed_reason:
            raise EnginesLost(self.dispatcher.closed_reason)
        if self.options.partial_rollout:
            self.carry = leftovers
        else:  # drop partial work, keep the prompts and ids
            self.carry = [Group.fresh(g.group_id, g.prompt_ids, self.n_samples) for g in leftovers]
        res.carried = len(self.carry)
        res.resent = self.dispatcher.resent - resent0
        res.unrouted_aborts = self.dispatcher.unrouted_aborts - unrouted0
        res.wall_s = time.monotonic() - t0
        return res


def group_record(group: Group) -> dict:
    """One JSONL line for a finished group: tokens, rewards, routed-expert shape + checksum, engines, the weight
    version of every token (`weight_version_spans`, rollout/versions.py), timings."""
    samples = []
    for s in group.samples:
        re = s.routed_experts
        samples.append({
            "sample_id": s.sample_id, "status": s.status, "error": s.error,
            "response_ids": s.response_ids, "response_len": len(s.response_ids),
            "logprob_sum": round(sum(s.logprobs), 6), "reward": s.reward,
            "routed_experts": None if re is None else {
                "shape": list(re.shape), "dtype": str(re.dtype),
                "sha256": hashlib.sha256(re.tobytes()).hexdigest()[:16]},
            "engine": s.engine, "dp_rank": s.dp_rank, "engines": s.engines,
            "attempts": s.attempts, "resumes": s.resumes,
            "weight_versions": sorted(set(s.weight_versions)), "weight_version_spans": version_spans(s),
            "latency_s": round(s.t_done - s.t_submit, 4),
        })
    return {"group_id": group.group_id, "prompt_ids": group.prompt_ids, "samples": samples}
