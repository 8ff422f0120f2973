"""Async dispatch of samples to admitted engines.

Bounded concurrency per engine (`capacity` requests in flight), least-outstanding routing, one
POST /generate per sample asking for logprobs and (optionally) routed experts. When an engine is
removed (dead), its in-flight attempts are cancelled and the samples are re-sent to another engine
from scratch; a sample yields exactly one result however many attempts it took.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp
import numpy as np

from rollout.engines.readiness import auth_headers


@dataclass
class Sample:
    sample_id: str                 # "<group_id>/<index>": the dedupe key
    group_id: str
    index: int
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    routed_experts: Optional[np.ndarray] = None   # compact [len(tokens)-1, moe_layers, topk]
    status: str = "pending"        # completed | truncated | aborted | failed
    error: Optional[str] = None
    reward: Optional[float] = None
    engines: list = field(default_factory=list)   # engine of every attempt, in order
    attempts: int = 0
    resumes: int = 0               # partial-rollout continuations
    max_new_tokens: Optional[int] = None   # per-sample override of sampling.max_new_tokens
    weight_versions: list = field(default_factory=list)
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
        return any(s.status == "failed" for s in self.samples)


class EngineLost(Exception):
    """The engine of an attempt was removed while the request was in flight."""


class _Slot:
    def __init__(self, engine, capacity):
        self.engine, self.capacity = engine, capacity
        self.outstanding = 0
        self.served = 0
        self.suspect_until = 0.0                      # after a connection error: avoid for a moment
        self.inflight: dict[str, asyncio.Task] = {}   # rid -> attempt task


class Dispatcher:
    def __init__(self, session: aiohttp.ClientSession, sampling: dict, capacity: int,
                 routed_experts: bool = False, decode_routed: Optional[Callable] = None,
                 max_attempts: int = 8, request_timeout_s: float = 3600.0, on_error=None):
        self.session = session
        self.sampling = dict(sampling)
        self.capacity = capacity
        self.routed_experts = routed_experts
        self.decode_routed = decode_routed     # (payload, num_tokens, start_len) -> (array|None, reason|None)
        self.max_attempts = max_attempts
        self.on_error = on_error               # async (engine) -> None, after a connection-level error
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.slots: dict[str, _Slot] = {}
        self._cond = asyncio.Condition()
        self._rid = itertools.count()
        self.resent = 0
        self.draining = False          # batch full: send nothing new, let the caller keep the sample
        self.closed_reason: Optional[str] = None

    # ------------------------------------------------------------------ engines
    async def admit(self, engine) -> None:
        async with self._cond:
            self.slots[engine.name] = _Slot(engine, self.capacity)
            self._cond.notify_all()

    async def remove(self, engine) -> int:
        """Take an engine out of rotation; its in-flight attempts fail with EngineLost (re-sent)."""
        async with self._cond:
            slot = self.slots.get(engine.name)
            if slot is None or slot.engine is not engine:
                return 0
            del self.slots[engine.name]
        n = 0
        for task in list(slot.inflight.values()):
            if not task.done():
                task.cancel()
                n += 1
        return n

    async def close(self, reason: str) -> None:
        """No engine will come back: waiting samples fail with `reason`."""
        async with self._cond:
            self.closed_reason = reason
            self._cond.notify_all()

    def outstanding(self) -> dict:
        return {n: s.outstanding for n, s in self.slots.items()}

    async def _acquire(self) -> _Slot:
        async with self._cond:
            while True:
                if self.closed_reason:
                    raise RuntimeError(self.closed_reason)
                now = time.monotonic()
                free = [s for s in self.slots.values() if s.outstanding < s.capacity and s.suspect_until <= now]
                if free:
                    slot = min(free, key=lambda s: (s.outstanding, s.served))
                    slot.outstanding += 1
                    return slot
                try:
                    await asyncio.wait_for(self._cond.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass

    async def _release(self, slot: _Slot, served: bool = True) -> None:
        async with self._cond:
            slot.outstanding -= 1
            slot.served += int(served)
            self._cond.notify_all()

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
        while True:
            if self.draining:
                break
            if sample.attempts >= self.max_attempts:
                sample.status, sample.error = "failed", f"gave up after {sample.attempts} attempts ({sample.error})"
                break
            try:
                slot = await self._acquire()
            except RuntimeError as e:
                sample.status, sample.error = "failed", str(e)
                break
            if self.draining:
                await self._release(slot, served=False)
                break
            sample.attempts += 1
            rid = f"{sample.sample_id}#{next(self._rid)}"
            attempt = asyncio.ensure_future(self._post(slot, self.payload(sample, rid)))
            slot.inflight[rid] = attempt
            try:
                out = await asyncio.shield(attempt)
            except asyncio.CancelledError:
                if attempt.cancelled() and not _being_cancelled():
                    out = EngineLost(f"engine {slot.engine.name} lost")  # removed by the manager
                else:
                    attempt.cancel()
                    raise
            except Exception as e:  # connection refused/reset, timeouts
                out = e
            finally:
                slot.inflight.pop(rid, None)
                await self._release(slot)
            sample.engines.append(slot.engine.name)
            if isinstance(out, Exception):
                sample.error = _short(out)
                self.resent += 1
                if not isinstance(out, EngineLost):
                    slot.suspect_until = time.monotonic() + 1.0
                    if self.on_error:
                        await self.on_error(slot.engine)
                continue
            status, body = out
            if status >= 500:
                sample.error = f"HTTP {status} from {slot.engine.name}"
                self.resent += 1
                continue
            if status != 200:
                sample.status, sample.error = "failed", f"HTTP {status} from {slot.engine.name}: {str(body)[:160]}"
                break
            self._apply(sample, body)
            break
        sample.t_done = time.monotonic()
        return sample

    async def _post(self, slot: _Slot, body: dict):
        async with self.session.post(slot.engine.url + "/generate", json=body,
                                     headers=auth_headers(slot.engine.api_key), timeout=self.timeout) as r:
            if r.status == 200:
                return r.status, await r.json()
            return r.status, await r.text()

    def _apply(self, sample: Sample, out: dict) -> None:
        meta = out.get("meta_info", {})
        pairs = meta.get("output_token_logprobs") or []
        start_len = len(sample.tokens) - 1 if sample.response_ids else 0
        sample.response_ids = list(sample.response_ids) + [int(p[1]) for p in pairs]
        sample.logprobs = list(sample.logprobs) + [float(p[0]) for p in pairs]
        if meta.get("weight_version") is not None:
            sample.weight_versions.append(str(meta["weight_version"]))
        finish = (meta.get("finish_reason") or {}).get("type")
        sample.status = {"stop": "completed", "length": "truncated", "abort": "aborted"}.get(finish, "completed")
        sample.error = None
        if self.routed_experts:
            self._apply_routed(sample, meta, start_len)

    def _apply_routed(self, sample: Sample, meta: dict, start_len: int) -> None:
        payload = meta.get("routed_experts")
        if payload is None:
            sample.status, sample.error = "failed", "routed experts requested but missing from meta_info"
            return
        arr, reason = self.decode_routed(payload, len(sample.tokens), start_len)
        if reason:
            sample.status, sample.error = "failed", f"routed experts: {reason}"
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


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return bool(task and task.cancelling())


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {s}"[:160] if s else type(e).__name__
