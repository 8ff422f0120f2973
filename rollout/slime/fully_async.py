"""slime's fully-async rollout on the rollout manager (for slime's `train_async.py`):

    --rollout-function-path rollout.slime.generate_rollout_fully_async

A pool of groups stays in flight across slime's steps: groups are taken from slime's data source (one at a
time, as slime's own fully-async worker does) and run by the manager on the adapter's event loop, in the
background, between the trainer's calls and across its weight updates. The pool holds
`ceil(concurrency x engines / n_samples_per_prompt)` groups (at least one per engine DP rank), and stops topping
up while that many finished groups wait for the trainer. Each call returns `rollout_batch_size` finished groups
(fewer only when the data source runs dry) as soon as they exist, sorted by index; the rest stay for the next
call. Placement, exactly-once, slime's hooks, rewards, dynamic filter and FAILED handling are plugin mode's
(`sink.Sink`). With `--custom-generate-function-path` each group runs the user's function per sample, as plugin
mode does (`custom.Step`, in the background: `custom` module doc); a group it returns with an ABORTED sample is
not delivered but run again as it is (slime's fully-async puts such groups back in its buffer).

Every sample carries the weight version of every response token: slime's `Sample.weight_versions` as slime
fills it (one per SGLang answer), and `metadata["weight_version_spans"]`, `[{"version", "start", "end"}, ...]`
over the response (SGLang's own span format: an answer that spans a weight update says which tokens each
version sampled; older releases answer one version per answer). Tokens a sample already held when it came from
slime's buffer take its first `weight_versions` entry (unknown: the oldest). A custom function's sample: the
spans of its turns' answers (a turn per span list; a tool's tokens between turns are in none), and one
`weight_versions` entry per answer where the function added none.

Staleness bound, `max_weight_version_lag` (`rollout.max_weight_version_lag` in $SLIME_MOE_ROLLOUT_CONFIG, or
$SLIME_MOE_ROLLOUT_MAX_WEIGHT_VERSION_LAG; unset: no bound): a group whose oldest token was sampled by a version
older than `current - lag` is never delivered. `rollout.stale_groups` says what happens instead:
`regenerate` (default: the group starts again from its prompt under the current weights) or `drop` (its prompt
is not trained). Both are counted: `rollout/stale_groups` per call. It is checked when a group finishes (before
its reward) and again when the trainer takes it. `current` is the newest version any engine reports
(`/model_info`) or any answer carried; versions compare as integers (slime's are), else in the order first seen.
An answer without spans (SGLang before 0.5.19 names only the version at finish) bounds its group by the version
current when the group started.
"""
from __future__ import annotations

import asyncio
import copy
import math
import os
import sys
from typing import Optional

from rollout.errors import EngineError
from rollout.slime import custom, flags
from rollout.slime.convert import flat, refuse_multimodal, version_spans
from rollout.slime.partial import manager_group
from rollout.slime.sink import Sink, on_one_rank
from rollout.slime.state import STATE, ensure, loop, slime_helper
from rollout.slime.types import RolloutFnTrainOutput
from rollout.types import SampleStatus
from rollout.versions import Versions

__all__ = ["generate_rollout_fully_async", "reset", "staleness", "version_spans"]

LAG_ENV = "SLIME_MOE_ROLLOUT_MAX_WEIGHT_VERSION_LAG"
POLICY_ENV = "SLIME_MOE_ROLLOUT_STALE_GROUPS"
POLICIES = ("regenerate", "drop")
SPANS = "weight_version_spans"
_NEVER = 1 << 62   # the pool's manager rollouts never fill a batch: nothing is aborted at a call's end
_POOL: Optional["Pool"] = None


def staleness(args) -> tuple:
    """(max_weight_version_lag or None, "regenerate" | "drop"): the environment, else slime's args
    (`max_weight_version_lag`, `stale_groups`), else the YAML named by $SLIME_MOE_ROLLOUT_CONFIG."""
    lag, policy = os.environ.get(LAG_ENV), os.environ.get(POLICY_ENV)
    lag = getattr(args, "max_weight_version_lag", None) if lag in (None, "") else lag
    policy = policy or getattr(args, "stale_groups", None)
    path = os.environ.get("SLIME_MOE_ROLLOUT_CONFIG") or getattr(args, "slime_moe_rollout_config", None)
    if path and (lag is None or policy is None):
        from training_configs.schema import load_config
        r = load_config(path).rollout
        lag = r.max_weight_version_lag if lag is None else lag
        policy = policy or r.stale_groups
    try:
        lag = None if lag is None else int(lag)
    except ValueError:
        raise ValueError(f"max_weight_version_lag {lag!r} is not an integer (${LAG_ENV})") from None
    if lag is not None and lag < 0:
        raise ValueError(f"max_weight_version_lag {lag} < 0: give 0 (every token of the current version) or more")
    policy = policy or "regenerate"
    if policy not in POLICIES:
        raise ValueError(f"stale_groups {policy!r}: give one of {', '.join(POLICIES)} (${POLICY_ENV})")
    return lag, policy


class Pool:
    """Groups in flight across slime's calls; finished ones wait in `ready` (slime groups, oldest first)."""

    def __init__(self, args, backend, tokenizer, data_source, step: Optional[custom.Step] = None):
        self.args, self.backend, self.tokenizer, self.data_source = args, backend, tokenizer, data_source
        self.lag, self.policy = staleness(args)
        self.step = step           # the user's custom generate functions (`custom.Step`, background), or None
        self.sink = step.sink(_NEVER) if step else Sink(args, STATE.pending, backend.layout, _NEVER)   # plugin mode's
        self.versions = Versions()
        self.fresh: dict = {}      # manager group id -> the slime group as the data source gave it
        self.flying: set = set()   # manager group ids started, not finished
        self.floor: dict = {}      # manager group id -> the current version when it started
        self.redo: list = []       # stale groups to start again
        self.ready: list = []      # (slime group, spans per sample, its fresh copy, on one rank)
        self.tasks: set = set()
        self.error: Optional[BaseException] = None
        self.wake = asyncio.Event()
        self.dry = False           # the data source gave nothing last time
        self.stale = {"regenerate": 0, "drop": 0}
        self.stale_tokens = 0      # response tokens of stale groups, thrown away
        self.one_rank = 0          # delivered groups whose every attempt ran on one (engine, DP rank)
        self.aborted = 0           # custom groups returned with an ABORTED sample, run again
        self.reported = self.counters()   # the counters at the previous call's metrics
        self.size, self.want = 1, 1

    def sized(self, want: int) -> None:
        """Groups in flight: the engines' concurrency over the group size, at least one per DP rank."""
        slots = list(getattr(self.backend.dispatcher, "slots", {}).values())
        cap = sum(getattr(s, "capacity", self.backend.options.concurrency) for s in slots)
        ranks = sum(getattr(s, "dp_ranks", 1) for s in slots)
        self.size = max(1, ranks, math.ceil(cap / self.backend.n_samples))
        self.want = want

    # ------------------------------------------------------------------ the manager's side
    def top_up(self) -> list:
        """Groups to start now: stale ones again, then new ones while the pool has room."""
        out, self.redo = self._admit(self.redo), []
        while (len(self.flying) < self.size and len(self.ready) < max(self.size, self.want)
               and self.error is None):
            got = self.data_source.get_samples(1)
            self.dry = not got
            if not got:
                break
            out += self._admit(got, keep=True)
        return out

    def _admit(self, slime_groups: list, keep: bool = False) -> list:
        if self.step is None:
            refuse_multimodal(slime_groups)
        groups = []
        for sg in slime_groups:
            g = self.step.group(sg) if self.step else manager_group(self.backend, sg, self.tokenizer)
            self.fresh[g.group_id] = copy.deepcopy(sg) if keep else sg.fresh
            STATE.pending[g.group_id] = sg
            self.flying.add(g.group_id)
            self.floor[g.group_id] = self.versions.current
            groups.append(g)
        if self.step:
            self.step.open(groups, slime_groups)
        return groups

    def launch(self, groups: list) -> None:
        if groups:
            task = asyncio.ensure_future(self.backend.rollout(groups, self, batch_size=_NEVER, refill=self.top_up,
                                                              run=self.step.run if self.step else None))
            self.tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        self.wake.set()

    async def put(self, group) -> bool:
        """The manager's sink: a finished group, stale or ready. Never 'taken' (the pool's rollouts never
        fill), so the manager asks `top_up` for the next group at once."""
        self.flying.discard(group.group_id)
        slime_group = STATE.pending[group.group_id]
        if self.step:   # the user's functions: the spans of their turns' answers, kept by the front
            own, spans, spanned = self.step.turns.pop(group.group_id, ([], [], True))
            spans = own + spans
            for s, sp in zip(flat(slime_group), own):
                s.metadata = dict(s.metadata or {}, **{SPANS: sp})
        else:
            own = spans = [version_spans(ms, (s.weight_versions or [None])[0])
                           for ms, s in zip(group.samples, slime_group)]
            spanned = all(m.get("weight_versions") for ms in group.samples for _, _, m in ms.outputs)
        for sp in spans:
            for s in sp:
                self.versions.see(s["version"])
        floor = self.floor.pop(group.group_id, None)
        if floor is not None and not spanned:
            spans = spans + [[{"version": floor}]]   # an answer without spans (before 0.5.19): no older than that
        failed = any(ms.status is SampleStatus.FAILED for ms in group.samples)   # plugin mode's FAILED rule first
        if not failed and (self._aborted(group.group_id, slime_group)
                           or self._stale(group.group_id, spans, _tokens(group, slime_group, self.step))):
            STATE.pending.pop(group.group_id, None)
        else:
            fresh = self.fresh.pop(group.group_id)
            if await self.sink.put(group):   # filled, hooks, reward, dynamic filter: as plugin mode
                self.sink.groups = [g for g in self.sink.groups if g is not slime_group]
                if self.step is None:
                    for s, sp in zip(slime_group, own):
                        s.metadata = dict(s.metadata or {}, **{SPANS: sp})
                self.ready.append((list(slime_group), spans, fresh, on_one_rank(group.samples)))
        self.sink.all_groups.clear()   # slime's all-samples process is not run here (nor by slime's fully async)
        self.wake.set()
        return False

    def _aborted(self, group_id, slime_group) -> bool:
        """A custom group returned with an ABORTED sample is run again as it is, never delivered (slime's
        fully-async looks at the group's samples, not into a function's `list[Sample]`)."""
        if self.step is None or not any(not isinstance(s, list) and s.status == s.Status.ABORTED
                                        for s in slime_group):
            return False
        self.aborted += 1
        self.redo.append(_Fresh(self.fresh.pop(group_id), as_is=slime_group))
        return True

    def _stale(self, group_id, spans, tokens: int) -> bool:
        """Stale groups are regenerated (from the prompt) or dropped, and counted; never delivered."""
        if self.lag is None or self.versions.lag(spans) <= self.lag:
            return False
        self.stale[self.policy] += 1
        self.stale_tokens += tokens
        fresh = self.fresh.pop(group_id)
        if self.policy == "regenerate":
            self.redo.append(_Fresh(fresh))
        return True

    # ------------------------------------------------------------------ the trainer's side
    async def take(self, want: int) -> list:
        """Up to `want` finished groups, (slime group, spans), as soon as they exist."""
        self.sized(want)
        asked = asyncio.ensure_future(self._current())   # the engines' versions, asked beside the wait
        if self.lag is not None:
            await asked   # the bound needs them before a ready group is judged
        out: list = []
        try:
            await self._wait(want, out)
        except BaseException:
            asked.cancel()
            raise
        await asked   # before the caller publishes the current version (a restarted engine must match it)
        return out

    async def _wait(self, want: int, out: list) -> None:
        """Fill `out` with ready groups, starting more, until `want` (or nothing is left to run)."""
        while len(out) < want:
            if self.error is not None:
                raise self.error
            while self.ready and len(out) < want:
                slime_group, spans, fresh, one = self.ready.pop(0)
                if self.lag is not None and self.versions.lag(spans) > self.lag:   # went stale while waiting
                    self.stale[self.policy] += 1
                    self.stale_tokens += sum(s.response_length for s in flat(slime_group))
                    if self.policy == "regenerate":
                        self.redo.append(_Fresh(fresh))
                    continue
                out.append((slime_group, spans))
                self.one_rank += one
            self.launch(self.top_up())
            if len(out) >= want:
                break
            if not self.flying and not self.ready and not self.redo and self.dry and not self.tasks:
                break   # the data source ran dry and nothing is left in flight
            self.wake.clear()
            await self.wake.wait()

    async def _current(self) -> None:
        """The version the engines serve now (they say it on /model_info; all asked at once)."""
        async def one(slot):
            try:
                return await self.backend.client.weight_version(slot.engine)
            except (EngineError, AttributeError):   # an engine that does not say: its answers still count
                return None
        for version in await asyncio.gather(*map(one, getattr(self.backend.dispatcher, "slots", {}).values())):
            self.versions.see(version)

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


    def counters(self) -> dict:
        return {"stale": dict(self.stale), "one_rank": self.one_rank, "failed": self.sink.failed_groups,
                "stale_tokens": self.stale_tokens, "aborted": self.aborted,
                "requests": self.step.front.requests if self.step else 0}


def _tokens(group, slime_group, step) -> int:
    """The group's response tokens (a custom function's: as it returned them)."""
    if step is None:
        return sum(len(ms.response_ids) for ms in group.samples)
    return sum(s.response_length for s in flat(slime_group))


class _Fresh(list):
    """A slime group to start again from its prompt (its first copy kept as `fresh`), or `as_is`."""

    def __init__(self, group, as_is=None):
        super().__init__(copy.deepcopy(group) if as_is is None else as_is)
        self.fresh = group


def generate_rollout_fully_async(args, rollout_id, data_source, evaluation=False):
    """slime `--rollout-function-path` entry point for `train_async.py` (slime's fully-async contract)."""
    global _POOL
    flags.refuse(args)
    if evaluation:
        return slime_helper("eval", "evaluation=True (slime's eval rollout)")(args, rollout_id, data_source,
                                                                       evaluation=True)
    backend, tokenizer = ensure(args)
    n, want = int(args.n_samples_per_prompt), int(args.rollout_batch_size)
    if backend.n_samples != n:
        raise ValueError(f"backend generates {backend.n_samples} samples per prompt, slime asks for {n}")
    if _POOL is None or _POOL.backend is not backend or _POOL.data_source is not data_source:
        if _POOL is not None:
            loop().run(_POOL.stop())
        line = flags.fully_async_warning(args)
        if line:
            print(line, file=sys.stderr, flush=True)
        step = custom.Step(args, backend, tokenizer, STATE.pending, background=True) if custom.active(args) else None
        _POOL = loop().run(_new_pool(args, backend, tokenizer, data_source, step))
    pool = _POOL
    data, metrics = loop().run(_take(pool, want))
    if pool.versions.current is not None:
        backend.set_weight_version(pool.versions.current)   # what a restarted engine must match
    return RolloutFnTrainOutput(samples=data, metrics=metrics)


async def _new_pool(args, backend, tokenizer, data_source, step) -> Pool:
    return Pool(args, backend, tokenizer, data_source, step)   # its Event belongs to the adapter's loop


async def _take(pool: Pool, want: int) -> tuple:
    """The call's groups (sorted by index) and metrics, on the pool's loop."""
    await pool.backend.relist(max_age_s=5.0)   # the workers slime's router lists now
    taken = await pool.take(want)
    data = sorted((g for g, _ in taken), key=lambda g: flat(g)[0].index or 0)
    before, pool.reported = pool.reported, pool.counters()
    now = pool.reported
    metrics = dict(pool.sink.filter.metrics())   # counts since the previous call (the pool runs in between)
    metrics.update({
        "rollout/groups": len(data), "rollout/pool_groups": pool.size, "rollout/in_flight_groups": len(pool.flying),
        "rollout/ready_groups": len(pool.ready),
        "rollout/stale_groups": sum(now["stale"].values()) - sum(before["stale"].values()),
        "rollout/stale_regenerated": now["stale"]["regenerate"] - before["stale"]["regenerate"],
        "rollout/stale_dropped": now["stale"]["drop"] - before["stale"]["drop"],
        "rollout/stale_tokens": now["stale_tokens"] - before["stale_tokens"],
        "rollout/max_weight_version_lag": pool.lag, "rollout/weight_version": pool.versions.current,
        "rollout/delivered_lag_max": max((pool.versions.lag(spans) for _, spans in taken), default=0.0),
        "rollout/groups_on_one_rank": now["one_rank"] - before["one_rank"],
        "rollout/failed_groups": now["failed"] - before["failed"]})
    if pool.step:
        metrics["rollout/custom_generate_requests"] = now["requests"] - before["requests"]
        metrics["rollout/aborted_groups_rerun"] = now["aborted"] - before["aborted"]
    return data, metrics


def reset() -> None:
    """Stop the pool (its groups in flight are cancelled) and the adapter's backend."""
    global _POOL
    if _POOL is not None:
        loop().run(_POOL.stop())
        _POOL = None
    STATE.reset()
