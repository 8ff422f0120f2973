"""The rollout manager: start engines, admit them after full readiness, stream GRPO groups, recover.

    async with RolloutManager.from_config(cfg, backend, model_path) as mgr:
        result = await mgr.rollout(prompts, sink, batch_size=N)    # groups reach `sink` as they finish

Recovery: the health monitor (or a dead process) removes an engine; its in-flight samples are
re-sent to the others; the engine is restarted and re-admitted only after every readiness phase
and, once weights were updated (`set_weight_version`), after the weight-version check hook.
Partial rollout: when `batch_size` groups are delivered, the remaining requests are aborted and
their groups kept, with tokens so far, for the next `rollout()` call (they are continued first).
Every restart failure (whatever its exception) is logged and counted, restarts back off, and when
every engine is given up `rollout()` raises `EnginesLost` at once, one line naming engines and causes.
Group ids are `<run_id>-g<n>` (`run_id` random unless given), unique across managers and runs;
`new_group(prompt, index=i)` fixes `n` (`run --resume` re-creates the same ids).

Engines started by someone else: `attach(endpoints)`, or `attach(discover=...)` for a list that
changes (slime's router): re-read by `relist()` and after a connection error. One sample outside any
group, with its own sampling params: `generate(sample, sampling)`. Unfinished groups kept for the
next step: `carried`, `drop_carried()`.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import aiohttp

from rollout.dispatch import Dispatcher
from rollout.engines.health import HEALTH_WINDOW_ENV, SGLANG_HEALTH_WINDOW_S, HealthMonitor, http_probe
from rollout.engines.readiness import NullView, auth_headers, dp_ranks, wait_ready
from rollout.errors import EnginesLost, WeightVersionError, one_line
from rollout.placement import Placement
from rollout.routed_experts import MoELayout, engine_offers
from rollout.types import EngineEvent, Group, Sample, SampleStatus, group_id

__all__ = ["EnginesLost", "Event", "RolloutManager", "RolloutResult", "WeightVersionError", "group_record"]

WeightHook = Callable[[object, str], Awaitable[None]]
Discover = Callable[[aiohttp.ClientSession], Awaitable[tuple]]   # -> (send to, abort on) lists of Endpoint


@dataclass(frozen=True)
class Event:
    seq: int                 # 0, 1, ... per manager: `events_since(seq)` reads only what is new
    t: float                 # time.monotonic()
    engine: str
    kind: EngineEvent
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value


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
    def __init__(self, specs, backend, *, budgets, health, sampling: dict, n_samples: int,
                 concurrency: int, layout: Optional[MoELayout] = None, seeds: Optional[list] = None,
                 keep_answers: bool = False, view=None, weight_sync_hook: Optional[WeightHook] = None,
                 max_restarts: int = 3, partial_rollout: bool = True, health_probe=None,
                 run_id: Optional[str] = None, restart_backoff_s: float = 1.0, restart_backoff_max_s: float = 30.0,
                 max_events: int = 10000, group_placement: str = "group"):
        """`layout`: ask for, check and keep routed experts; `seeds`, `keep_answers`: see `Dispatcher`."""
        self.specs = {s.name: s for s in specs}
        self.backend = backend
        self.budgets, self.health_cfg = budgets, health
        self.sampling, self.n_samples, self.concurrency = dict(sampling), n_samples, concurrency
        self.layout, self.seeds, self.keep_answers = layout, seeds, keep_answers
        self.group_placement = group_placement       # "group" (rollout/placement.py) or "sample"
        self.view = view or NullView()
        self.weight_sync_hook = weight_sync_hook
        self.weight_version: Optional[str] = None
        self.max_restarts, self.partial_rollout = max_restarts, partial_rollout
        self._health_probe = health_probe
        self.restart_backoff_s, self.restart_backoff_max_s = restart_backoff_s, restart_backoff_max_s
        self.engines: dict[str, object] = {}
        self.events: collections.deque[Event] = collections.deque(maxlen=max_events)  # bounded for long serves
        self._seq = itertools.count()
        self.restart_failures: collections.Counter = collections.Counter()   # engine -> failed restarts
        self.given_up: dict[str, str] = {}                                 # engine -> last cause
        self.carry: list[Group] = []
        self._recoveries: dict[str, asyncio.Task] = {}
        self.run_id = run_id or uuid.uuid4().hex[:10]
        self._gid = itertools.count()
        self.session: Optional[aiohttp.ClientSession] = None
        self.dispatcher: Optional[Dispatcher] = None
        self.monitor: Optional[HealthMonitor] = None
        self._discover: Optional[Discover] = None
        self._abort_to: Optional[list] = None        # engines to abort on when the batch is full (default: admitted)
        self._listing: Optional[asyncio.Future] = None
        self._listed_at = 0.0
        self.empty_wait_s = 0.0                      # set by attach(discover=...)
        self.routed_formats: dict[str, str] = {}     # engine -> "routed experts: compact" or ": int32 (why)"

    @classmethod
    def from_config(cls, cfg, backend, model_path: str, *, api_key=None, ports=None, **kw):
        from rollout.config import engine_specs
        specs = engine_specs(cfg, model_path, api_key=api_key, ports=ports)
        r = cfg.rollout
        sampling = {"temperature": r.sampling.temperature, "top_p": r.sampling.top_p,
                    "top_k": r.sampling.top_k, "max_new_tokens": r.sampling.max_new_tokens}
        layout = MoELayout.from_model(cfg.model) if any(g.routed_experts for g in cfg.engine_groups) else None
        return cls(specs, backend, budgets=r.budgets, health=r.health, sampling=sampling,
                   n_samples=r.n_samples_per_prompt, concurrency=r.concurrency_per_engine,
                   layout=layout, partial_rollout=r.partial_rollout, group_placement=r.group_placement, **kw)

    @property
    def routed_experts(self) -> bool:
        return self.layout is not None

    def log(self, engine: str, kind: EngineEvent, detail: str = "") -> Event:
        ev = Event(next(self._seq), time.monotonic(), engine, EngineEvent(kind), detail)
        self.events.append(ev)
        return ev

    def events_since(self, seq: int) -> list:
        """Events with seq >= `seq` still held (the oldest drop off after `max_events`)."""
        return [e for e in self.events if e.seq >= seq]

    def count(self, kind: EngineEvent) -> int:
        return sum(e.kind == kind for e in self.events)

    # ------------------------------------------------------------------ start / stop
    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        self.dispatcher = self._dispatcher(self._on_error)
        probe = self._health_probe or http_probe(self.session, self.health_cfg.timeout_s)
        self.monitor = HealthMonitor(probe, self._on_dead, self.health_cfg.interval_s, self.health_cfg.failures,
                                     server_window_s=self._server_health_window())
        results = await asyncio.gather(*(self._bring_up(spec) for spec in self.specs.values()),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        self.monitor.start()

    def _server_health_window(self) -> float:
        """SGLang's /health_generate window: the longest SGLANG_HEALTH_CHECK_TIMEOUT an engine group sets."""
        windows = [float(s.group.env[HEALTH_WINDOW_ENV]) for s in self.specs.values()
                   if HEALTH_WINDOW_ENV in getattr(s.group, "env", {})]
        return max(windows, default=SGLANG_HEALTH_WINDOW_S)

    def _dispatcher(self, on_error) -> Dispatcher:
        return Dispatcher(self.session, self.sampling, self.concurrency, layout=self.layout, seeds=self.seeds,
                          keep_answers=self.keep_answers, on_error=on_error,
                          placement=Placement(self.n_samples, self.concurrency)
                          if self.group_placement == "group" else None)

    async def attach(self, endpoints=(), discover: Optional[Discover] = None,
                     empty_wait_s: float = 60.0) -> "RolloutManager":
        """Use engines started by someone else: open the HTTP session and admit each endpoint (`.name`,
        `.url`, `.api_key`). Nothing is launched and no health monitor runs. With `discover` (async
        (session) -> (endpoints to send to, endpoints to abort on); its `str` names it in errors) the
        engines are those it lists now, and again at every `relist()` and after a connection error; an
        empty list is re-read for up to `empty_wait_s` before samples fail."""
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._discover, self.empty_wait_s = discover, empty_wait_s
        self.dispatcher = self._dispatcher(self._relist_after_error if discover else None)
        for endpoint in endpoints:
            await self.dispatcher.admit(endpoint, await self.reported_version(endpoint),
                                        await self.offers_compact(endpoint), await self.engine_dp_ranks(endpoint))
        if discover is not None:
            try:
                await self.relist()
            except BaseException:
                await self.session.close()
                raise
        return self

    async def relist(self, max_age_s: float = 0.0, wait_s: Optional[float] = None) -> None:
        """Follow what `discover` lists now (no-op without it, or when it was read under `max_age_s` ago):
        admit new engines, remove gone ones (their requests are re-sent). Concurrent calls share one read."""
        if self._discover is None or time.monotonic() - self._listed_at < max_age_s:
            return
        if self._listing is None or self._listing.done():
            wait = self.empty_wait_s if wait_s is None else wait_s
            self._listing = asyncio.ensure_future(self._relist(time.monotonic() + wait))
        await asyncio.shield(self._listing)

    async def _relist(self, until: float) -> None:
        while True:
            send, abort = await self._discover(self.session)
            if send or time.monotonic() >= until:
                break
            await asyncio.sleep(0.5)
        self._abort_to = list(abort) or None
        names = {e.name for e in send}
        for slot in list(self.dispatcher.slots.values()):
            if slot.engine.name not in names:
                await self.dispatcher.remove(slot.engine)
        for e in send:
            if e.name not in self.dispatcher.slots:
                await self.dispatcher.admit(e, await self.reported_version(e), await self.offers_compact(e),
                                            await self.engine_dp_ranks(e))
        self._listed_at = time.monotonic()
        if send:
            await self.dispatcher.reopen()
        else:
            await self.dispatcher.close(f"{self._discover} lists no workers")

    async def _relist_after_error(self, engine) -> None:
        """A connection error: whoever started the engines may have removed or replaced that one."""
        try:
            await self.relist(max_age_s=1.0, wait_s=0.0)
        except RuntimeError:
            pass

    async def _bring_up(self, spec, restart: bool = False):
        """Start one engine and admit it after every readiness phase (and the weight check)."""
        engine = await asyncio.to_thread(self.backend.start, spec)
        self.engines[spec.name] = engine
        self.log(spec.name, EngineEvent.STARTED, f"pid {engine.pid}")
        try:
            info = await wait_ready(engine, self.budgets, self.session, self.view)
            if restart and self.weight_version is not None:
                await self._check_weights(engine, info.weight_version)
        except BaseException:
            await asyncio.to_thread(engine.stop)
            raise
        await self.dispatcher.admit(engine, info.weight_version, await self.offers_compact(engine),
                                    dp_ranks=info.dp_size)
        self.monitor.watch(engine)
        self.log(spec.name, EngineEvent.ADMITTED, self.routed_formats.get(spec.name, ""))
        return engine

    async def stop(self) -> None:
        if self.monitor:
            await self.monitor.stop()
        for t in self._recoveries.values():
            t.cancel()
        for t in list(self._recoveries.values()):
            try:
                await t
            except BaseException:
                pass
        await asyncio.gather(*(asyncio.to_thread(e.stop) for e in self.engines.values()),
                             return_exceptions=True)
        if self.session:
            await self.session.close()
        if self.backend is not None:   # None when attached to engines started elsewhere
            await asyncio.to_thread(self.backend.shutdown)

    # ------------------------------------------------------------------ weights
    def set_weight_version(self, version: str) -> None:
        """Call after every weight update: restarted engines must then report this version."""
        self.weight_version = str(version)

    async def _check_weights(self, engine, reported: Optional[str]) -> None:
        if reported != self.weight_version and self.weight_sync_hook is not None:
            await self.weight_sync_hook(engine, self.weight_version)
            reported = await self.engine_weight_version(engine)
        if reported != self.weight_version:
            raise WeightVersionError(f"engine {engine.name}: weight version {reported!r} != expected "
                                     f"{self.weight_version!r}; not admitted")

    async def engine_weight_version(self, engine) -> Optional[str]:
        async with self.session.get(engine.url + "/model_info", headers=auth_headers(engine.api_key),
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:
            return (await r.json()).get("weight_version")

    async def reported_version(self, engine) -> Optional[str]:
        """The engine's weight version, or None when it does not say (the dispatcher's retraction check)."""
        try:
            return await self.engine_weight_version(engine)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError):
            return None

    async def engine_dp_ranks(self, engine) -> Optional[int]:
        """An attached engine's DP ranks from `/server_info` (None when it does not say: one target)."""
        if self.group_placement != "group":
            return None
        try:
            async with self.session.get(engine.url + "/server_info", headers=auth_headers(engine.api_key),
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                return dp_ranks(await r.json()) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError):
            return None

    async def offers_compact(self, engine) -> bool:
        """Probed once per admission: does the engine advertise compact routed experts for this model
        (`/server_info`)? If not, it is asked for SGLang's int32 format; `routed_formats` says why."""
        if self.layout is None:
            return False
        try:
            async with self.session.get(engine.url + "/server_info", headers=auth_headers(engine.api_key),
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                info = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            info = {"internal_states": None, "error": one_line(e)}
        ok, why = engine_offers(info, self.layout)
        self.routed_formats[engine.name] = "routed experts: compact" if ok else f"routed experts: int32 ({why})"
        return ok

    # ------------------------------------------------------------------ recovery
    async def _on_error(self, engine) -> None:
        """A request to `engine` failed at the connection level: if its process is gone, act now."""
        if not engine.alive() and self.monitor.watched.get(engine.name) is engine:
            self.monitor.unwatch(engine)
            await self._on_dead(engine, engine.exit_reason())

    async def _on_dead(self, engine, reason: str) -> None:
        n = await self.dispatcher.remove(engine)
        self.log(engine.name, EngineEvent.DEAD, f"{reason}; {n} in-flight request(s) re-sent")
        if engine.name not in self._recoveries or self._recoveries[engine.name].done():
            task = asyncio.create_task(self._recover(engine, reason))
            task.add_done_callback(lambda t, name=engine.name: self._recovery_done(name, t))
            self._recoveries[engine.name] = task

    async def _recover(self, engine, cause: str) -> None:
        """Restart with backoff; any exception of an attempt is logged, counted and retried."""
        spec = self.specs[engine.name]
        try:
            await asyncio.to_thread(engine.stop)
        except Exception as e:  # a dead engine that cannot be stopped cleanly is still restarted
            self.log(spec.name, EngineEvent.RESTART_FAILED, f"stopping the dead process: {one_line(e, 300)}")
        for attempt in range(1, self.max_restarts + 1):
            if attempt > 1:
                await asyncio.sleep(min(self.restart_backoff_max_s, self.restart_backoff_s * 2 ** (attempt - 2)))
            try:
                await self._wait_port(spec)
                await self._bring_up(spec, restart=True)
            except Exception as e:
                cause = one_line(e, 300)
                self.restart_failures[spec.name] += 1
                self.log(spec.name, EngineEvent.RESTART_FAILED, f"restart {attempt}: {cause}")
                continue
            self.log(spec.name, EngineEvent.READMITTED, f"restart {attempt} passed every readiness phase")
            return
        await self._give_up(spec.name, cause)

    def _recovery_done(self, name: str, task: asyncio.Task) -> None:
        """Belt and braces: a recovery task that died of an unexpected error still gives the engine up."""
        if task.cancelled() or task.exception() is None or name in self.given_up:
            return
        cause = f"recovery crashed: {one_line(task.exception())}"
        self.log(name, EngineEvent.RESTART_FAILED, cause)
        asyncio.get_running_loop().create_task(self._give_up(name, cause))

    async def _give_up(self, name: str, cause: str) -> None:
        self.given_up[name] = cause
        self.log(name, EngineEvent.GIVEN_UP, f"{self.max_restarts} restart(s) failed (last: {cause})")
        others = [t for n, t in self._recoveries.items() if n != name and not t.done()]
        if not self.dispatcher.slots and not others:
            reason = "every engine is lost: " + "; ".join(f"{n}: {c}" for n, c in sorted(self.given_up.items()))
            self.log(name, EngineEvent.ALL_LOST, reason)
            await self.dispatcher.close(reason)

    async def _wait_port(self, spec, budget_s: float = 15.0) -> None:
        from rollout.engines.process import port_in_use
        end = time.monotonic() + budget_s
        while port_in_use(spec.host, spec.port) and time.monotonic() < end:
            await asyncio.sleep(0.2)

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
        return await self.dispatcher.run(sample, None if sampling is None else {**self.sampling, **sampling})

    async def rollout(self, prompts, sink, batch_size: Optional[int] = None, on_group=None) -> RolloutResult:
        """Run groups (carried-over first, then one per prompt or `Group`) until `batch_size` are delivered
        to `sink`.

        Groups still running when the batch is full are aborted and kept for the next call, under the
        same ids (with partial_rollout with their tokens so far; otherwise started again from the prompt).
        """
        todo = self.carry + [p if isinstance(p, Group) else self.new_group(p) for p in prompts]
        self.carry = []
        batch_size = batch_size or len(todo)
        res = RolloutResult()
        t0 = time.monotonic()
        full = asyncio.Event()
        resent0, unrouted0 = self.dispatcher.resent, self.dispatcher.unrouted_aborts
        engines = max(1, len(self.specs), len(self.dispatcher.slots))   # attached: no specs
        limit = max(1, math.ceil(self.concurrency * engines / self.n_samples)) * 2
        gate = asyncio.Semaphore(limit)
        leftovers: list[Group] = []

        async def run_group(group: Group):
            try:
                while True:
                    runs = [s for s in group.samples if s.status.runnable]
                    if not runs or full.is_set() or self.dispatcher.closed_reason:
                        break
                    for s in runs:
                        if s.status is SampleStatus.ABORTED:
                            s.resumes += 1
                    await asyncio.gather(*(self.dispatcher.run(s) for s in runs))
                unfinished = any(s.status.runnable for s in group.samples)
                if full.is_set() or self.dispatcher.closed_reason or unfinished:
                    leftovers.append(group)
                    return
                if await sink.put(group):
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
                            await self.dispatcher.abort(self._abort_to)  # stragglers return with their tokens so far
            finally:
                gate.release()

        tasks = []
        for group in todo:
            await gate.acquire()
            if full.is_set():
                gate.release()
                leftovers.append(group)
                continue
            tasks.append(asyncio.create_task(run_group(group)))
        await asyncio.gather(*tasks)
        self.dispatcher.draining = False
        if self.dispatcher.closed_reason:
            raise EnginesLost(self.dispatcher.closed_reason)
        if self.partial_rollout:
            self.carry = leftovers
        else:  # drop partial work, keep the prompts and ids
            self.carry = [Group.fresh(g.group_id, g.prompt_ids, self.n_samples) for g in leftovers]
        res.carried = len(self.carry)
        res.resent = self.dispatcher.resent - resent0
        res.unrouted_aborts = self.dispatcher.unrouted_aborts - unrouted0
        res.wall_s = time.monotonic() - t0
        return res


def group_record(group: Group) -> dict:
    """One JSONL line for a finished group: tokens, rewards, routed-expert shape + checksum, engines, timings."""
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
            "weight_versions": sorted(set(s.weight_versions)),
            "latency_s": round(s.t_done - s.t_submit, 4),
        })
    return {"group_id": group.group_id, "prompt_ids": group.prompt_ids, "samples": samples}
