"""Async dispatch of samples to admitted engines.

Bounded concurrency per engine (`capacity` requests in flight), least-outstanding routing, one
POST /generate per sample asking for logprobs and (optionally) routed experts. When an engine is
removed (dead), its in-flight attempts are cancelled and the samples are re-sent to another engine
from scratch; a sample yields exactly one result however many attempts it took. 5xx answers, connection errors
and malformed answers (read by `engines.answer` only) are re-sent after a bounded backoff; a sample fails after
`max_attempts` failed tries in a row (any answer, a normal abort too, resets the count). With routed experts on, an
abort that brings no `routed_experts` (SGLang aborts a request still queued when the batch fills
that way, see tests/facts/) keeps none of that attempt's tokens: the sample stays `aborted` as it was
before the attempt and is resumed later, so every kept token has its routing row. Every answer's
routed experts go through `routed_experts.sample_routed_experts` (decode, validate, merge segments);
an engine admitted with `compact` is asked for them in the plugin's compact format (either is decoded).
Options for callers that speak for another trainer (the slime adapter): `seeds` (per-index
`sampling_seed`), `keep_answers` (every answer's text and meta_info on `sample.outputs`), and a
per-call `sampling` override of `run`. Every HTTP call goes through the engine client (`engines.client`).
Which engines are admitted, their DP ranks and load in flight live in one place, `engines.state.EngineTable`
(`self.engines`; placement and the sources read it). Which engine gets a sample is decided in one place,
`place`: with a `Placement` (rollout/placement.py) each sample goes to the (engine, DP rank) it places it
on, waiting for that engine's free slot, instead of the least-outstanding engine.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Optional

from rollout import versions
from rollout.engines.answer import Answer, BadAnswer, parse
from rollout.engines.client import EngineClient
from rollout.engines.readiness import dp_ranks as dp_ranks_of
from rollout.engines.state import EngineEntry, EngineTable
from rollout.errors import (DispatcherClosed, EngineError, EngineLost, EngineRejected, EngineUnreachable, one_line,
                            short_error)
from rollout.placement import Placement
from rollout.routed_experts import MoELayout, continuation_start, engine_offers, opt_in, sample_routed_experts
from rollout.types import FINISH_STATUS, Sample, SampleStatus


class Dispatcher:
    def __init__(self, client: EngineClient, sampling: dict, capacity: int,
                 layout: Optional[MoELayout] = None, seeds: Optional[list] = None, keep_answers: bool = False,
                 max_attempts: int = 8, request_timeout_s: float = 3600.0, on_error=None,
                 backoff_s: float = 0.2, backoff_max_s: float = 5.0, placement: Optional[Placement] = None):
        self.client = client
        self.sampling = dict(sampling)
        self.capacity = capacity
        self.layout = layout                   # MoE layout: routed experts asked for, checked and merged
        self.seeds = seeds                     # sampling_seed of sample i: seeds[i % len(seeds)]
        self.keep_answers = keep_answers       # append (tokens, text, meta_info) of every answer to sample.outputs
        self.max_attempts = max_attempts
        self.on_error = on_error               # async (engine) -> None, after a connection-level error
        self.request_timeout_s = request_timeout_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.engines = EngineTable()           # admitted engines, their ranks and load: the one owner
        self._cond = asyncio.Condition()
        # futures of samples waiting for a slot, FIFO: per placed engine, or under None for any engine
        self._waiters: dict[Optional[str], collections.deque] = {}
        self.placement = placement             # group placement, or None: least-outstanding engine per sample
        if placement is not None:
            self.engines.listen(admitted=lambda e: placement.admit(e.name, e.dp_ranks),
                                removed=lambda e: placement.remove(e.name))
        self._timer = None             # one wake-up when a suspect slot's pause ends
        self._rid = itertools.count()
        self.resent = 0
        self.unrouted_aborts = 0       # aborted answers without routed experts (queued when aborted)
        self.draining = False          # batch full: send nothing new, let the caller keep the sample

    @property
    def routed_experts(self) -> bool:
        return self.layout is not None

    @property
    def slots(self) -> dict[str, EngineEntry]:
        return self.engines.slots

    @property
    def closed_reason(self) -> Optional[str]:
        return self.engines.closed_reason

    @property
    def routed_formats(self) -> dict[str, str]:
        return self.engines.routed_formats

    # ------------------------------------------------------------------ engines
    async def admit(self, engine, weight_version: Optional[str] = None, compact: bool = False,
                    dp_ranks: Optional[int] = None, replicas: bool = False) -> None:
        """`compact`: the engine advertised compact routed experts for this model (asked for per request);
        `dp_ranks`: its DP ranks as readiness probed them (pinned when > 1; `replicas`: plain --dp-size)."""
        async with self._cond:
            version = None if weight_version is None else str(weight_version)
            self.engines.admit(engine, self.capacity, dp_ranks, version, compact and self.routed_experts, replicas)
        self._wake_all()

    async def enlist(self, engine, weight_version: Optional[str] = None, ask_version: bool = True,
                     dp_ranks: Optional[int] = None, replicas: bool = False) -> None:
        """Admit after asking the engine what dispatch needs: its weight version (when `ask_version`; None when
        it does not say), with routed experts on whether it advertises them compact (if not, it is asked for
        SGLang's int32 format and `routed_formats` says why) and, with a placement and no `dp_ranks` given,
        its attention-DP ranks (all from `/server_info`)."""
        if ask_version:
            try:
                weight_version = await self.client.weight_version(engine)
            except (EngineError, AttributeError):
                weight_version = None
        ask_ranks = self.placement is not None and dp_ranks is None
        info = await self._server_info(engine) if self.layout is not None or ask_ranks else {}
        if ask_ranks and info and "error" not in info:
            dp_ranks = dp_ranks_of(info)
        await self.admit(engine, weight_version, self._offers_compact(engine, info), dp_ranks, replicas)

    async def _server_info(self, engine) -> dict:
        try:
            return await self.client.server_info(engine)
        except EngineRejected:
            return {}
        except EngineUnreachable as e:
            return {"internal_states": None, "error": one_line(e)}

    def _offers_compact(self, engine, info: dict) -> bool:
        if self.layout is None:
            return False
        ok, why = engine_offers(info, self.layout)
        self.routed_formats[engine.name] = "routed experts: compact" if ok else f"routed experts: int32 ({why})"
        return ok

    async def remove(self, engine) -> int:
        """Take an engine out of rotation; its in-flight attempts fail with EngineLost (re-sent)."""
        async with self._cond:
            slot = self.engines.remove(engine)
            if slot is None:
                return 0
        if self.placement is not None:
            self._wake_all()             # samples waiting for it are placed again
        n = 0
        for rid, task in list(slot.inflight.items()):
            if not task.done():
                slot.lost.add(rid)
                task.cancel()
                n += 1
        return n

    async def close(self, reason: str) -> None:
        """No engine will come back: waiting samples fail with `reason`."""
        async with self._cond:
            self.engines.close(reason)
        self._wake_all()

    async def reopen(self) -> None:
        """Engines are back (e.g. listed again by whoever started them): serve samples again."""
        async with self._cond:
            self.engines.reopen()
        self._wake_all()

    def outstanding(self) -> dict:
        return self.engines.outstanding()

    def place(self, sample: Sample) -> Optional[str]:
        """Which engine `sample` must go to (its group's placement), or None: any free engine, the least
        outstanding, then the least served. The one placement decision; the rest of dispatch only books slots."""
        if self.placement is None:
            return None
        key = self.placement.place(sample, self._cost(sample), self.engines.suspects())
        return key and key[0]

    def longest_first(self, groups: list) -> list:
        """`groups` in the order placement balances best (with a placement): the most predicted tokens
        first (the prompt once, then every sample's remaining budget), so the small groups placed last fill
        the ranks level (longest-processing-time-first); without a placement, as given."""
        if self.placement is None:
            return list(groups)
        def tokens(g):
            return len(g.prompt_ids) + sum(self._cost(s) - len(s.prompt_ids) for s in g.samples if s.status.runnable)
        return sorted(groups, key=tokens, reverse=True)

    def _take(self, name: Optional[str] = None) -> Optional[EngineEntry]:
        """A free slot (see `EngineTable.take`), taken, or None; when only suspect slots are free, the
        waiters are woken as the first pause ends."""
        slot, paused = self.engines.take(name)
        if paused is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(paused - time.monotonic(), self._wake_all)
        return slot

    async def _acquire(self, sample: Sample) -> EngineEntry:
        """A slot (of the engine `sample` is placed on, with a placement), for a caller whose `_take` found
        none free: waits FIFO (woken one at a time by _release, all at once by admit/remove/close or when a
        suspect slot's pause ends: no polling, no thundering herd), then takes one."""
        name = self.place(sample)
        while True:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(name, collections.deque()).append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_one(name)  # we were handed a wake-up we will not use: pass it on
                raise
            name = self.place(sample)
            slot = self._take(name)
            if slot is not None:
                return slot

    def _wake_one(self, name: Optional[str] = None) -> None:
        """Wake the first waiter for engine `name`, else the first waiting for any engine."""
        for key in (name, None) if name else (None,):
            queue, woken = self._waiters.get(key), False
            while queue and not woken:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)
                    woken = True
            if queue is not None and not queue:
                del self._waiters[key]
            if woken:
                return

    def _wake_all(self) -> None:
        self._timer = None
        waiters, self._waiters = self._waiters, {}
        for queue in waiters.values():
            for fut in queue:
                if not fut.done():
                    fut.set_result(None)

    def _release(self, slot: EngineEntry, served: bool = True) -> None:
        slot.release(served)
        if self._waiters:
            self._wake_one(slot.engine.name if self.placement else None)

    # ------------------------------------------------------------------ requests
    def budget_left(self, sample: Sample) -> int:
        """Tokens the sample may still generate: its budget (`max_new_tokens`) minus its response."""
        return int(sample.max_new_tokens or self.sampling.get("max_new_tokens", 16)) - len(sample.response_ids)

    def _cost(self, sample: Sample) -> int:
        return len(sample.prompt_ids) + len(sample.response_ids) + max(0, self.budget_left(sample))

    def payload(self, sample: Sample, rid: str, sampling: Optional[dict] = None, compact: bool = False,
                budget: Optional[int] = None) -> dict:
        """The /generate body; `sampling` (a per-call override) is sent as given, without `seeds`;
        `compact`: routed experts asked for in the compact format (the engine advertised it); `budget`:
        `budget_left(sample)` when the caller has it."""
        sp = dict(self.sampling if sampling is None else sampling)
        if self.seeds and sampling is None:
            sp["sampling_seed"] = self.seeds[sample.index % len(self.seeds)]
        sp["max_new_tokens"] = max(1, budget if budget is not None else self.budget_left(sample))
        body = {"input_ids": sample.tokens, "sampling_params": sp, "return_logprob": True, "rid": rid}
        if self.routed_experts:
            body["return_routed_experts"] = True
            start = continuation_start(sample.routed_experts, sample.num_tokens)
            if start:
                body["routed_experts_start_len"] = start
            if compact:
                body["sampling_params"] = opt_in(sp)
        return body

    async def run(self, sample: Sample, sampling: Optional[dict] = None) -> Sample:
        """Generate (or continue) one sample; retries (see the module doc); never raises for an engine fault.
        A sample with no budget left is TRUNCATED without a request. `sampling`: see `payload`."""
        sample.t_submit = sample.t_submit or time.monotonic()
        budget = self.budget_left(sample)   # the same for every attempt of this call
        if budget <= 0:
            sample.status, sample.t_done = SampleStatus.TRUNCATED, time.monotonic()
            return sample
        retries = 0                    # consecutive re-sends of this call: the backoff exponent
        # Each attempt runs in this task (no extra task per request); remove() cancels this task and
        # marks the rid lost, which is told apart from any other cancellation of the caller.
        task = asyncio.current_task()
        while True:
            if self.draining:
                break
            if sample.failures >= self.max_attempts:
                sample.status = SampleStatus.FAILED
                sample.error = f"gave up after {sample.failures} failed attempts in a row ({sample.error})"
                break
            if retries:
                await asyncio.sleep(min(self.backoff_max_s, self.backoff_s * 2 ** (retries - 1)))
            try:   # a free slot at once (the usual case) without a coroutine of its own; else wait for one
                name = None if self.placement is None else self.place(sample)
                if name is not None:
                    await self._primed(sample, name)
                    name = self.place(sample)      # the same rank, unless its engine went meanwhile
                slot = self._take(name)
                if slot is None:
                    slot = await self._acquire(sample)
            except DispatcherClosed as e:
                sample.status, sample.error = SampleStatus.FAILED, str(e)
                break
            if self.draining:
                self._release(slot, served=False)
                self._unplace(sample, None)
                break
            sample.attempts += 1
            rid = f"{sample.sample_id}#{next(self._rid)}"
            slot.inflight[rid] = task
            sample.sent_version = slot.version
            out = None
            try:
                body = self.payload(sample, rid, sampling, slot.compact, budget)
                if self.placement is not None:
                    self._pin(sample, body)
                out = parse(slot.engine.name, await self.client.generate(slot.engine, body,
                                                                         timeout_s=self.request_timeout_s))
            except asyncio.CancelledError:
                if rid in slot.lost and task.uncancel() == 0:
                    out = EngineLost(f"engine {slot.engine.name} lost")  # removed by the manager
                else:
                    raise
            except EngineError as e:
                out = e
            finally:
                slot.inflight.pop(rid, None)
                if slot.lost:
                    slot.lost.discard(rid)
                slot.release(True)   # _release, inline: this runs for every request
                if self._waiters:
                    self._wake_one(slot.engine.name if self.placement else None)
                if self.placement is not None:
                    self._unplace(sample, out)
            sample.engines.append(slot.engine.name)
            if type(out) is Answer:          # the usual case first: it runs for every request
                sample.failures = 0
                self._apply(sample, out)
                if out.weight_version is not None:
                    slot.version = out.weight_version
                break
            sample.failures += 1
            if isinstance(out, (EngineLost, EngineUnreachable)):   # re-send elsewhere
                sample.error = short_error(out.cause if isinstance(out, EngineUnreachable) else out)
                self.resent += 1
                retries += isinstance(out, EngineUnreachable)  # a lost engine's samples go elsewhere at once
                if isinstance(out, EngineUnreachable):
                    slot.suspect_until = time.monotonic() + 1.0
                    if self.on_error:
                        await self.on_error(slot.engine)
                continue
            if isinstance(out, (EngineRejected, BadAnswer)):
                sample.error = one_line(out)     # "HTTP 503 on /generate from e: ...", "malformed answer from e: ..."
                if isinstance(out, BadAnswer):   # sent elsewhere first (as after a connection error)
                    slot.suspect_until = time.monotonic() + 1.0
                if out.transient:   # 5xx, a malformed answer: re-sent after the backoff
                    self.resent += 1
                    retries += 1
                    continue
            sample.status = SampleStatus.FAILED   # a rejection that will not change (a 4xx)
            break
        sample.t_done = time.monotonic()
        return sample

    def _pin(self, sample: Sample, body: dict) -> None:
        """Pin `body` to the sample's DP rank (the engine picks where it has one)."""
        held = self.placement.current.get(sample.sample_id)
        rank = held and self.placement.rank_param(held[0])
        if rank is not None:
            body["routed_dp_rank"] = rank

    async def _primed(self, sample: Sample, name: str) -> None:
        """A fresh group's samples wait for one zero-token request of its prompt on their rank, sent by the
        first of them before any takes a slot (a slot held through the wait would idle): the primer is
        outside the engine's slots, one request per fresh group beyond them. It is cancelled with its
        engine (`remove`): the samples go anyway, placed again."""
        held, entry = self.placement.current.get(sample.sample_id), self.slots.get(name)
        if held is None or entry is None or self.draining:
            return
        key, task = held[0], asyncio.current_task()
        rank = self.placement.rank_param(key)

        async def prime():
            rid = f"{sample.group_id}@{key[1]}#{next(self._rid)}"
            primer = {"input_ids": list(sample.prompt_ids), "sampling_params": {"max_new_tokens": 0}, "rid": rid}
            if rank is not None:
                primer["routed_dp_rank"] = rank
            entry.inflight[rid] = task
            try:
                out = await self.client.generate(entry.engine, primer, timeout_s=self.request_timeout_s)
            except asyncio.CancelledError:
                if rid in entry.lost and task.uncancel() == 0:
                    raise EngineError(f"engine {name} lost") from None
                raise
            finally:
                entry.inflight.pop(rid, None)
                entry.lost.discard(rid)
            a = parse(name, out)
            return {"prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens}
        await self.placement.primed_once(sample, key, prime)

    def _unplace(self, sample: Sample, out) -> None:
        if self.placement is not None:
            work = out.prompt_tokens - out.cached_tokens + out.completion_tokens if isinstance(out, Answer) else 0
            self.placement.done(sample, work)

    def _apply(self, sample: Sample, out: Answer) -> None:
        before = len(sample.response_ids)
        self._take_answer(sample, out)
        if self.keep_answers:
            sample.outputs.append((len(sample.response_ids) - before, out.text, out.kept()))

    def _take_answer(self, sample: Sample, out: Answer) -> None:
        routed = self.layout is not None
        if routed and out.finish == "abort" and out.meta.get("routed_experts") is None:
            # aborted before it ran (queued when the batch filled): nothing to keep, resume later
            self.unrouted_aborts += 1
            sample.status, sample.error = SampleStatus.ABORTED, None
            return
        start_len = continuation_start(sample.routed_experts, sample.num_tokens) if routed else 0
        if sample.response_ids:   # a continuation; a first answer's lists are the parser's own, taken as they are
            sample.response_ids = [*sample.response_ids, *out.token_ids]
            sample.logprobs = [*sample.logprobs, *out.logprobs]
        else:
            sample.response_ids, sample.logprobs = out.token_ids, out.logprobs
        versions.note(sample, len(out.token_ids), out.meta)
        sample.status = FINISH_STATUS.get(out.finish, SampleStatus.COMPLETED)
        sample.error = None
        if routed:
            arr, reason = sample_routed_experts(out.meta, sample.num_tokens, self.layout, held=sample.routed_experts,
                                                start_len=start_len, sent_version=sample.sent_version)
            if reason:
                sample.status, sample.error = SampleStatus.FAILED, f"routed experts: {reason}"
                return
            sample.routed_experts = arr

    async def abort(self, endpoints=None) -> None:
        """Ask every engine (or each of `endpoints`) to abort all its requests (stragglers once a batch is full)."""
        async def one(engine):
            try:
                await self.client.abort_all(engine)
            except EngineError:
                pass   # a gone engine has nothing left to abort
        targets = [s.engine for s in self.slots.values()] if endpoints is None else list(endpoints)
        await asyncio.gather(*(one(e) for e in targets))
