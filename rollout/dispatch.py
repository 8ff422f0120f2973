"""Async dispatch of samples to admitted engines.

Bounded concurrency per engine (`capacity` requests in flight), least-outstanding routing, one
POST /generate per sample asking for logprobs and (optionally) routed experts. When an engine is
removed (dead), its in-flight attempts are cancelled and the samples are re-sent to another engine
from scratch; a sample yields exactly one result however many attempts it took. 5xx answers and
connection errors are re-sent after a bounded exponential backoff. With routed experts on, an
abort that brings no `routed_experts` (SGLang aborts a request still queued when the batch fills
that way, see tests/facts/) keeps none of that attempt's tokens: the sample stays `aborted` as it was
before the attempt and is resumed later, so every kept token has its routing row.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp
import numpy as np

from rollout.net import auth_headers
from rollout.routed_experts.retraction import retraction_reason
from rollout.states import FINISH_STATUS, SampleStatus


@dataclass
class Sample:
    sample_id: str                 # "<group_id>/<index>": the dedupe key
    group_id: str
    index: int
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    routed_experts: Optional[np.ndarray] = None   # compact [len(tokens)-1, moe_layers, topk]
    status: SampleStatus = SampleStatus.PENDING
    error: Optional[str] = None
    reward: Optional[float] = None
    engines: list = field(default_factory=list)   # engine of every attempt, in order
    attempts: int = 0
    resumes: int = 0               # partial-rollout continuations
    max_new_tokens: Optional[int] = None   # per-sample override of sampling.max_new_tokens
    weight_versions: list = field(default_factory=list)
    sent_version: Optional[str] = None   # the engine's weight version last reported when the attempt was sent
    t_submit: float = 0.0
    t_done: float = 0.0

    @property
    def tokens(self) -> list:
        return list(self.prompt_ids) + list(self.response_ids)

    @property
    def engine(self) -> Optional[str]:
        return self.engines[-1] if self.engines else None


@dataclass
class Group:
    group_id: str
    prompt_ids: list
    samples: list

    @property
    def failed(self) -> bool:
        return any(s.status == SampleStatus.FAILED for s in self.samples)


class EngineLost(Exception):
    """The engine of an attempt was removed while the request was in flight."""


class _Slot:
    def __init__(self, engine, capacity):
        self.engine, self.capacity = engine, capacity
        self.outstanding = 0
        self.served = 0
        self.suspect_until = 0.0                      # after a connection error: avoid for a moment
        self.inflight: dict[str, asyncio.Task] = {}   # rid -> the task awaiting that attempt
        self.lost: set = set()                        # rids cancelled by remove()
        self.version: Optional[str] = None            # weight version the engine reported last
        self.headers = auth_headers(engine.api_key)


class Dispatcher:
    def __init__(self, session: aiohttp.ClientSession, sampling: dict, capacity: int,
                 routed_experts: bool = False, decode_routed: Optional[Callable] = None,
                 max_attempts: int = 8, request_timeout_s: float = 3600.0, on_error=None,
                 backoff_s: float = 0.2, backoff_max_s: float = 5.0):
        self.session = session
        self.sampling = dict(sampling)
        self.capacity = capacity
        self.routed_experts = routed_experts
        self.decode_routed = decode_routed     # (payload, num_tokens, start_len) -> (array|None, reason|None)
        self.max_attempts = max_attempts
        self.on_error = on_error               # async (engine) -> None, after a connection-level error
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10)
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.slots: dict[str, _Slot] = {}
        self._cond = asyncio.Condition()
        self._waiters: collections.deque = collections.deque()  # futures of samples waiting for a slot, FIFO
        self._timer = None             # one wake-up when a suspect slot's pause ends
        self._rid = itertools.count()
        self.resent = 0
        self.unrouted_aborts = 0       # aborted answers without routed experts (queued when aborted)
        self.draining = False          # batch full: send nothing new, let the caller keep the sample
        self.closed_reason: Optional[str] = None

    # ------------------------------------------------------------------ engines
    async def admit(self, engine, weight_version: Optional[str] = None) -> None:
        async with self._cond:
            slot = self.slots[engine.name] = _Slot(engine, self.capacity)
            slot.version = None if weight_version is None else str(weight_version)
        self._wake_all()

    async def remove(self, engine) -> int:
        """Take an engine out of rotation; its in-flight attempts fail with EngineLost (re-sent)."""
        async with self._cond:
            slot = self.slots.get(engine.name)
            if slot is None or slot.engine is not engine:
                return 0
            del self.slots[engine.name]
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
            self.closed_reason = reason
        self._wake_all()

    def outstanding(self) -> dict:
        return {n: s.outstanding for n, s in self.slots.items()}

    def _take(self) -> Optional[_Slot]:
        """The least-outstanding free slot, taken (no await: atomic on the event loop), or None."""
        if self.closed_reason:
            raise RuntimeError(self.closed_reason)
        now, best, paused = time.monotonic(), None, None
        for s in self.slots.values():
            if s.outstanding >= s.capacity:
                continue
            if s.suspect_until > now:
                paused = s.suspect_until if paused is None else min(paused, s.suspect_until)
            elif best is None or (s.outstanding, s.served) < (best.outstanding, best.served):
                best = s
        if best is not None:
            best.outstanding += 1
        elif paused is not None and self._timer is None:  # wake the waiters when the pause ends
            self._timer = asyncio.get_running_loop().call_later(paused - now, self._wake_all)
        return best

    async def _acquire(self) -> _Slot:
        """A slot; waits FIFO while none is free (woken one at a time by _release, all at once by
        admit/close or when a suspect slot's pause ends: no polling, no thundering herd)."""
        while True:
            slot = self._take()
            if slot is not None:
                return slot
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_one()  # we were handed a wake-up we will not use: pass it on
                raise

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _wake_all(self) -> None:
        self._timer = None
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def _release(self, slot: _Slot, served: bool = True) -> None:
        slot.outstanding -= 1
        slot.served += int(served)
        self._wake_one()

    # ------------------------------------------------------------------ requests
    def payload(self, sample: Sample, rid: str) -> dict:
        sp = dict(self.sampling)
        budget = sample.max_new_tokens or int(sp.get("max_new_tokens", 16))
        sp["max_new_tokens"] = max(1, budget - len(sample.response_ids))
        body = {"input_ids": sample.tokens, "sampling_params": sp, "return_logprob": True, "rid": rid}
        if self.routed_experts:
            body["return_routed_experts"] = True
            if sample.response_ids:
                body["routed_experts_start_len"] = len(sample.tokens) - 1
        return body

    async def run(self, sample: Sample) -> Sample:
        """Generate (or continue) one sample; retries on lost engines and 5xx; never raises for an engine fault."""
        sample.t_submit = sample.t_submit or time.monotonic()
        retries = 0                    # consecutive re-sends of this call: the backoff exponent
        # Each attempt runs in this task (no extra task per request); remove() cancels this task and
        # marks the rid lost, which is told apart from any other cancellation of the caller.
        task = asyncio.current_task()
        while True:
            if self.draining:
                break
            if sample.attempts >= self.max_attempts:
                sample.status = SampleStatus.FAILED
                sample.error = f"gave up after {sample.attempts} attempts ({sample.error})"
                break
            if retries:
                await asyncio.sleep(min(self.backoff_max_s, self.backoff_s * 2 ** (retries - 1)))
            try:
                slot = await self._acquire()
            except RuntimeError as e:
                sample.status, sample.error = SampleStatus.FAILED, str(e)
                break
            if self.draining:
                self._release(slot, served=False)
                break
            sample.attempts += 1
            rid = f"{sample.sample_id}#{next(self._rid)}"
            slot.inflight[rid] = task
            sample.sent_version = slot.version
            try:
                out = await self._post(slot, self.payload(sample, rid))
            except asyncio.CancelledError:
                if rid in slot.lost and task.uncancel() == 0:
                    out = EngineLost(f"engine {slot.engine.name} lost")  # removed by the manager
                else:
                    raise
            except Exception as e:  # connection refused/reset, timeouts
                out = e
            finally:
                slot.inflight.pop(rid, None)
                slot.lost.discard(rid)
                self._release(slot)
            sample.engines.append(slot.engine.name)
            if isinstance(out, Exception):
                sample.error = _short(out)
                self.resent += 1
                retries += not isinstance(out, EngineLost)  # a lost engine's samples go elsewhere at once
                if not isinstance(out, EngineLost):
                    slot.suspect_until = time.monotonic() + 1.0
                    if self.on_error:
                        await self.on_error(slot.engine)
                continue
            status, body = out
            if status >= 500:
                sample.error = f"HTTP {status} from {slot.engine.name}: {one_line(body)}"
                self.resent += 1
                retries += 1
                continue
            if status != 200:
                sample.status = SampleStatus.FAILED
                sample.error = f"HTTP {status} from {slot.engine.name}: {one_line(body)}"
                break
            self._apply(sample, body)
            version = body.get("meta_info", {}).get("weight_version")
            slot.version = slot.version if version is None else str(version)
            break
        sample.t_done = time.monotonic()
        return sample

    async def _post(self, slot: _Slot, body: dict):
        async with self.session.post(slot.engine.url + "/generate", json=body,
                                     headers=slot.headers, timeout=self.timeout) as r:
            if r.status == 200:
                return r.status, await r.json()
            return r.status, await r.text()

    def _apply(self, sample: Sample, out: dict) -> None:
        meta = out.get("meta_info", {})
        finish = (meta.get("finish_reason") or {}).get("type")
        if self.routed_experts and finish == "abort" and meta.get("routed_experts") is None:
            # aborted before it ran (queued when the batch filled): nothing to keep, resume later
            self.unrouted_aborts += 1
            sample.status, sample.error = SampleStatus.ABORTED, None
            return
        pairs = meta.get("output_token_logprobs") or []
        start_len = len(sample.tokens) - 1 if sample.response_ids else 0
        sample.response_ids = list(sample.response_ids) + [int(p[1]) for p in pairs]
        sample.logprobs = list(sample.logprobs) + [float(p[0]) for p in pairs]
        if meta.get("weight_version") is not None:
            sample.weight_versions.append(str(meta["weight_version"]))
        sample.status = FINISH_STATUS.get(finish, SampleStatus.COMPLETED)
        sample.error = None
        if self.routed_experts:
            self._apply_routed(sample, meta, start_len)

    def _apply_routed(self, sample: Sample, meta: dict, start_len: int) -> None:
        payload = meta.get("routed_experts")
        if payload is None:
            sample.status, sample.error = SampleStatus.FAILED, "routed experts requested but missing from meta_info"
            return
        reason = retraction_reason(meta, sample.sent_version)  # miles#3277: routes recomputed under newer weights
        arr, reason = (None, reason) if reason else self.decode_routed(payload, len(sample.tokens), start_len)
        if reason:
            sample.status, sample.error = SampleStatus.FAILED, f"routed experts: {reason}"
            return
        if start_len and sample.routed_experts is not None:
            # partial rollout: keep the rows computed by the first request, append the new ones
            arr = np.concatenate([sample.routed_experts[:start_len], arr], axis=0)
        sample.routed_experts = arr

    async def abort(self, rids_prefix: Optional[str] = None) -> None:
        """Ask every engine to abort all its requests (used for stragglers once a batch is full)."""
        async def one(slot):
            try:
                async with self.session.post(slot.engine.url + "/abort_request", json={"abort_all": True},
                                             headers=auth_headers(slot.engine.api_key),
                                             timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
        await asyncio.gather(*(one(s) for s in list(self.slots.values())))


def one_line(x, limit: int = 160) -> str:
    """Any text (an answer body, an exception) as one line of at most `limit` characters."""
    text = " ".join(str(x).split()) or (type(x).__name__ if isinstance(x, BaseException) else "")
    return text[:limit]


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {s}"[:160] if s else type(e).__name__
