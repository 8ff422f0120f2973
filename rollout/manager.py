"""The rollout manager: start engines, admit them after full readiness, stream GRPO groups, recover.

    async with RolloutManager.from_config(cfg, backend, model_path) as mgr:
        result = await mgr.rollout(prompts, sink, batch_size=N)    # groups reach `sink` as they finish

Recovery: the health monitor (or a dead process) removes an engine; its in-flight samples are
re-sent to the others; the engine is restarted and re-admitted only after every readiness phase
and, once weights were updated (`set_weight_version`), after the weight-version check hook.
Partial rollout: when `batch_size` groups are delivered, the remaining requests are aborted and
their groups kept, with tokens so far, for the next `rollout()` call (they are continued first).
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import aiohttp

from rollout.dispatch import Dispatcher, Group, Sample
from rollout.engines.health import HealthMonitor, http_probe
from rollout.engines.lifecycle import EngineStartError
from rollout.engines.readiness import NullView, ReadinessError, auth_headers, wait_ready

WeightHook = Callable[[object, str], Awaitable[None]]


class WeightVersionError(RuntimeError):
    pass


@dataclass
class RolloutResult:
    delivered: int = 0
    carried: int = 0                   # unfinished groups kept for the next step (partial rollout)
    failed_samples: int = 0
    resent: int = 0
    first_group_s: Optional[float] = None
    wall_s: float = 0.0
    per_engine: dict = field(default_factory=dict)   # engine -> samples finished there


class RolloutManager:
    def __init__(self, specs, backend, *, budgets, health, sampling: dict, n_samples: int,
                 concurrency: int, decode_routed=None, view=None, weight_sync_hook: Optional[WeightHook] = None,
                 max_restarts: int = 3, partial_rollout: bool = True, health_probe=None):
        self.specs = {s.name: s for s in specs}
        self.backend = backend
        self.budgets, self.health_cfg = budgets, health
        self.sampling, self.n_samples, self.concurrency = dict(sampling), n_samples, concurrency
        self.decode_routed = decode_routed
        self.view = view or NullView()
        self.weight_sync_hook = weight_sync_hook
        self.weight_version: Optional[str] = None
        self.max_restarts, self.partial_rollout = max_restarts, partial_rollout
        self._health_probe = health_probe
        self.engines: dict[str, object] = {}
        self.events: list[tuple[float, str, str]] = []   # (monotonic time, engine, what)
        self.carry: list[Group] = []
        self._recoveries: dict[str, asyncio.Task] = {}
        self._gid = itertools.count()
        self.session: Optional[aiohttp.ClientSession] = None
        self.dispatcher: Optional[Dispatcher] = None
        self.monitor: Optional[HealthMonitor] = None

    @classmethod
    def from_config(cls, cfg, backend, model_path: str, *, api_key=None, ports=None, **kw):
        from rollout.config import engine_specs
        specs = engine_specs(cfg, model_path, api_key=api_key, ports=ports)
        r = cfg.rollout
        sampling = {"temperature": r.sampling.temperature, "top_p": r.sampling.top_p,
                    "top_k": r.sampling.top_k, "max_new_tokens": r.sampling.max_new_tokens}
        decode = None
        if any(g.routed_experts for g in cfg.engine_groups):
            decode = routed_decoder(cfg.model)
        return cls(specs, backend, budgets=r.budgets, health=r.health, sampling=sampling,
                   n_samples=r.n_samples_per_prompt, concurrency=r.concurrency_per_engine,
                   decode_routed=decode, partial_rollout=r.partial_rollout, **kw)

    def log(self, engine: str, what: str) -> None:
        self.events.append((time.monotonic(), engine, what))

    # ------------------------------------------------------------------ start / stop
    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        self.dispatcher = Dispatcher(self.session, self.sampling, self.concurrency,
                                     routed_experts=self.decode_routed is not None,
                                     decode_routed=self.decode_routed, on_error=self._on_error)
        probe = self._health_probe or http_probe(self.session, self.health_cfg.timeout_s)
        self.monitor = HealthMonitor(probe, self._on_dead, self.health_cfg.interval_s, self.health_cfg.failures)
        results = await asyncio.gather(*(self._bring_up(spec) for spec in self.specs.values()),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        self.monitor.start()

    async def attach(self, endpoints, dispatcher_cls=Dispatcher) -> "RolloutManager":
        """Use engines started by someone else (e.g. slime's router): open the HTTP session and admit
        each endpoint (`.name`, `.url`, `.api_key`). Nothing is launched and no health monitor runs."""
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.dispatcher = dispatcher_cls(self.session, self.sampling, self.concurrency,
                                         routed_experts=self.decode_routed is not None,
                                         decode_routed=self.decode_routed)
        for endpoint in endpoints:
            await self.dispatcher.admit(endpoint)
        return self

    async def _bring_up(self, spec, restart: bool = False):
        """Start one engine and admit it after every readiness phase (and the weight check)."""
        engine = await asyncio.to_thread(self.backend.start, spec)
        self.engines[spec.name] = engine
        self.log(spec.name, f"started pid {engine.pid}")
        try:
            info = await wait_ready(engine, self.budgets, self.session, self.view)
            if restart and self.weight_version is not None:
                await self._check_weights(engine, info.weight_version)
        except BaseException:
            await asyncio.to_thread(engine.stop)
            raise
        await self.dispatcher.admit(engine)
        self.monitor.watch(engine)
        self.log(spec.name, "admitted")
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

    # ------------------------------------------------------------------ recovery
    async def _on_error(self, engine) -> None:
        """A request to `engine` failed at the connection level: if its process is gone, act now."""
        if not engine.alive() and self.monitor.watched.get(engine.name) is engine:
            self.monitor.unwatch(engine)
            await self._on_dead(engine, engine.exit_reason())

    async def _on_dead(self, engine, reason: str) -> None:
        n = await self.dispatcher.remove(engine)
        self.log(engine.name, f"dead: {reason}; {n} in-flight request(s) re-sent")
        if engine.name not in self._recoveries or self._recoveries[engine.name].done():
            self._recoveries[engine.name] = asyncio.create_task(self._recover(engine))

    async def _recover(self, engine) -> None:
        spec = self.specs[engine.name]
        await asyncio.to_thread(engine.stop)
        for attempt in range(1, self.max_restarts + 1):
            try:
                await self._wait_port(spec)
                await self._bring_up(spec, restart=True)
                self.log(spec.name, f"re-admitted after restart {attempt}")
                return
            except (ReadinessError, EngineStartError, WeightVersionError) as e:
                self.log(spec.name, f"restart {attempt} failed: {e}")
        self.log(spec.name, f"given up after {self.max_restarts} restarts")
        if not self.dispatcher.slots and all(t.done() for n, t in self._recoveries.items() if n != spec.name):
            await self.dispatcher.close(f"every engine is dead (last: {spec.name})")

    async def _wait_port(self, spec, budget_s: float = 15.0) -> None:
        from rollout.engines.lifecycle import port_in_use
        end = time.monotonic() + budget_s
        while port_in_use(spec.host, spec.port) and time.monotonic() < end:
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ rollout
    def new_group(self, prompt_ids) -> Group:
        gid = f"g{next(self._gid)}"
        samples = [Sample(f"{gid}/{i}", gid, i, list(prompt_ids)) for i in range(self.n_samples)]
        return Group(gid, list(prompt_ids), samples)

    async def rollout(self, prompts, sink, batch_size: Optional[int] = None, on_group=None) -> RolloutResult:
        """Run groups (carried-over first, then one per prompt) until `batch_size` are delivered to `sink`.

        Groups still running when the batch is full are aborted and kept for the next call (with
        partial_rollout; otherwise they are dropped from this step and returned as fresh prompts).
        """
        todo = self.carry + [self.new_group(p) for p in prompts]
        self.carry = []
        batch_size = batch_size or len(todo)
        res = RolloutResult()
        t0 = time.monotonic()
        full = asyncio.Event()
        resent0 = self.dispatcher.resent
        limit = max(1, math.ceil(self.concurrency * max(1, len(self.specs)) / self.n_samples)) * 2
        gate = asyncio.Semaphore(limit)
        leftovers: list[Group] = []

        async def run_group(group: Group):
            try:
                while True:
                    runs = [s for s in group.samples if s.status in ("pending", "aborted")]
                    if not runs or full.is_set():
                        break
                    for s in runs:
                        if s.status == "aborted":
                            s.resumes += 1
                    await asyncio.gather(*(self.dispatcher.run(s) for s in runs))
                if full.is_set() or any(s.status in ("pending", "aborted") for s in group.samples):
                    leftovers.append(group)
                    return
                if await sink.put(group):
                    res.delivered += 1
                    if res.first_group_s is None:
                        res.first_group_s = time.monotonic() - t0
                    if on_group:
                        on_group(group)
                    if res.delivered >= batch_size and not full.is_set():
                        full.set()
                        self.dispatcher.draining = True
                        if any(s.outstanding for s in self.dispatcher.slots.values()):
                            await self.dispatcher.abort()  # stragglers return with their tokens so far
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
        if self.partial_rollout:
            self.carry = leftovers
        else:  # drop partial work, keep the prompts
            self.carry = [self.new_group(g.prompt_ids) for g in leftovers]
        res.carried = len(self.carry)
        res.resent = self.dispatcher.resent - resent0
        res.wall_s = time.monotonic() - t0
        return res


def routed_decoder(model):
    """(payload, num_tokens, start_len) -> (compact array | None, reason | None), via rollout.routed_experts."""
    from rollout.routed_experts.layout import MoELayout
    from rollout.routed_experts.validate import try_decode_compact
    layout = MoELayout.from_first_k_dense(model.num_layers, model.first_k_dense_replace,
                                          model.num_experts, model.topk)

    def decode(payload, num_tokens, start_len):
        return try_decode_compact(payload, layout, num_tokens, start_len)

    return decode


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
            "engine": s.engine, "engines": s.engines, "attempts": s.attempts, "resumes": s.resumes,
            "weight_versions": sorted(set(s.weight_versions)),
            "latency_s": round(s.t_done - s.t_submit, 4),
        })
    return {"group_id": group.group_id, "prompt_ids": group.prompt_ids, "samples": samples}
