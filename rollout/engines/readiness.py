"""Phased readiness: an engine is admitted only after every phase passed within its own budget.

  process alive -> HTTP up -> server status Up -> /health_generate 200 -> one-token probe on every
  DP rank (`routed_dp_rank`) -> admitted

Every poll (<= 0.2 s apart, also while an HTTP call is pending) checks that the process is still
alive, so a death is seen within 1 s. The DP ranks to probe come from `/server_info` as each
reviewed SGLang reports them (`dp_ranks`); each probe must come back from the rank it was pinned to
when the answer names its rank (`meta_info.dp_rank`), so a probe that every rank answers from rank 0
cannot pass for all of them. Then the fixes: the plugin's report in `/server_info`
(`sglang_patches.report`) must show every fix the engine's configuration needs in a good state (a
reviewed SGLang, the plugin loaded, nothing disabled), else the engine is refused; `rollout.allow_unfixed:
true` admits it anyway and says so on one line. A failure raises `ReadinessError`: one line naming the engine,
the phase, its budget and the cause, with the last lines of the engine's log attached.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from sglang_patches.report import problem as fix_problem

from rollout.engines.answer import BadAnswer, parse
from rollout.engines.client import EngineClient
from rollout.errors import ApiKeyRejected, EngineRejected, EngineUnreachable, short_error

POLL_S = 0.2


@dataclass(frozen=True)
class Phase:
    key: str      # budget field name in ReadinessBudgets, without "_s"
    label: str


PHASES = (
    Phase("process", "process alive"),
    Phase("http", "HTTP up"),
    Phase("server_up", "server status Up"),
    Phase("health_generate", "/health_generate 200"),
    Phase("dp_probe", "one-token probe on every DP rank"),
)


class ReadinessError(RuntimeError):
    def __init__(self, engine: str, phase: str, budget: float, reason: str, log_tail: list[str]):
        self.engine, self.phase, self.budget, self.reason, self.log_tail = engine, phase, budget, reason, log_tail
        last = next((ln for ln in reversed(log_tail) if ln.strip()), "")
        tail = f" | last log line: {last.strip()[:200]}" if last else ""
        super().__init__(f"engine {engine}: phase '{phase}' failed (budget {budget:g} s): {reason}{tail}")


class _Dead(Exception):
    pass


class WrongRank(Exception):
    """A probe pinned to one DP rank came back from another."""


class NoToken(Exception):
    """A probe pinned to one DP rank came back without a token (the rank is not serving yet)."""


@dataclass
class ReadyInfo:
    dp_size: int                                 # DP ranks probed (routed_dp_rank 0..dp_size-1)
    weight_version: Optional[str]
    phase_s: dict = field(default_factory=dict)  # label -> seconds spent
    rank_answers: dict = field(default_factory=dict)  # probed rank -> `meta_info.dp_rank` of its answer
    server_info: Optional[dict] = None           # the last /server_info read (its fix report: admission)

    @property
    def total_s(self) -> float:
        return sum(self.phase_s.values())

    @property
    def replicas(self) -> bool:
        """The DP ranks are plain replicas (`plain_replicas` of the last /server_info read)."""
        return bool(self.server_info) and plain_replicas(self.server_info)


def dp_ranks(server_info: dict) -> int:
    """How many `routed_dp_rank` targets an engine has, from its `/server_info`.

    SGLang 0.5.23 resolves `--dp-size N --enable-dp-attention` to dp_size 1 and attn_dp_size N and
    routes over dp_size * attn_dp_size ranks (one of the two is 1; tests/facts/). 0.5.15.post1 and
    0.5.16 report their ServerArgs as given (dp_size N, no attn_dp_size) and route over dp_size,
    with or without DP attention.
    """
    dp = int(server_info.get("dp_size") or 1)
    return dp * int(server_info.get("attn_dp_size") or 1)


def plain_replicas(server_info: dict) -> bool:
    """Whether an engine's DP ranks are plain `--dp-size` replicas (no DP attention: they do not step
    together, so each is probed on its own after admission, `health.per_replica`)."""
    return int(server_info.get("dp_size") or 1) > 1 and not server_info.get("enable_dp_attention")


class NullView:
    """Progress view that shows nothing. A view gets every engine's phases as they start, and the end."""

    def phase(self, engine: str, index: int, label: str, budget: float) -> None: ...
    def admitted(self, engine: str, seconds: float) -> None: ...
    def failed(self, engine: str, message: str) -> None: ...


class RichView:
    """One rich progress row per engine: current phase, phases done, elapsed time."""

    def __init__(self, progress):
        self.progress = progress
        self.tasks: dict[str, int] = {}

    def _task(self, engine):
        if engine not in self.tasks:
            self.tasks[engine] = self.progress.add_task(engine, total=len(PHASES))
        return self.tasks[engine]

    def phase(self, engine, index, label, budget):
        self.progress.update(self._task(engine), completed=index,
                             description=f"{engine}: {label} (budget {budget:g} s)")

    def admitted(self, engine, seconds):
        self.progress.update(self._task(engine), completed=len(PHASES),
                             description=f"{engine}: admitted after {seconds:.1f} s")

    def failed(self, engine, message):
        self.progress.update(self._task(engine), description=f"{engine}: FAILED")


class LineView:
    """One line per phase through `say(text)` (restarted engines, logs, tests)."""

    def __init__(self, say):
        self.say = say

    def phase(self, engine, index, label, budget):
        self.say(f"{engine}: {label} (budget {budget:g} s)")

    def admitted(self, engine, seconds):
        self.say(f"{engine}: admitted after {seconds:.1f} s")

    def failed(self, engine, message):
        self.say(f"{engine}: FAILED: {message}")


def start_ready(backend, spec, budgets, view=None, allow_unfixed: bool = False) -> tuple:
    """Start one engine with `backend` and wait until every phase passed (blocking: tools, tests,
    benchmarks). Returns (engine, ReadyInfo); on any failure the engine is stopped and the error raised."""
    engine = backend.start(spec)

    async def wait():
        async with EngineClient() as client:
            return await wait_ready(engine, budgets, client, view, allow_unfixed=allow_unfixed)

    try:
        return engine, asyncio.run(wait())
    except BaseException:
        engine.stop()
        raise


async def _guard(engine, coro, deadline: float):
    """Await coro, but give up as soon as the process dies or the deadline passes."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if not engine.alive():
                raise _Dead()
            if time.monotonic() >= deadline:
                raise asyncio.TimeoutError()
    finally:
        if not task.done():
            task.cancel()


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


async def probe_dp_rank(client: EngineClient, engine, rank: Optional[int], timeout_s: float,
                        token_id: int = 1) -> Optional[int]:
    """A one-token greedy /generate pinned to one DP rank; raises on anything but a token back from
    that rank. Returns the rank the answer names (`meta_info.dp_rank`; None when it names none)."""
    payload = {"input_ids": [token_id], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if rank is not None:
        payload["routed_dp_rank"] = rank
    answer = parse(engine.name, await client.generate(engine, payload, timeout_s=timeout_s))
    if answer.completion_tokens < 1:
        raise NoToken(f"DP rank {rank}: no token generated")
    served = answer.meta.get("dp_rank")
    if served is not None and type(served) is not int:
        raise BadAnswer(engine.name, "meta_info.dp_rank", f"is {served!r}, not a rank")
    if rank is not None and served is not None and served != rank:
        raise WrongRank(f"DP rank {rank}: the probe was served by DP rank {served}")
    return served


async def wait_ready(engine, budgets, client: EngineClient, view=None,
                     dp_size: Optional[int] = None, allow_unfixed: bool = False) -> ReadyInfo:
    """Run every phase for one engine; returns ReadyInfo or raises ReadinessError (`allow_unfixed`:
    `rollout.allow_unfixed`, admit an engine whose needed fixes are not good, saying so)."""
    view = view or NullView()
    info = ReadyInfo(dp_size=dp_size or getattr(engine.spec, "dp_size", 1), weight_version=None)
    t_all = time.monotonic()
    for i, ph in enumerate(PHASES):
        budget = float(getattr(budgets, f"{ph.key}_s"))
        view.phase(engine.name, i, ph.label, budget)
        t0 = time.monotonic()
        deadline = t0 + budget
        last = "no answer yet"
        try:
            while True:
                if not engine.alive():
                    raise _Dead()
                try:
                    ok, last = await _guard(engine, _check(ph.key, client, engine, info, deadline), deadline)
                except ApiKeyRejected as e:
                    raise _Fatal(f"API key rejected by the server (HTTP {e.status} on {e.path})") from None
                except EngineUnreachable as e:
                    ok, last = False, short_error(e.cause)
                if ok:
                    break
                if time.monotonic() + POLL_S >= deadline:
                    raise asyncio.TimeoutError()
                await asyncio.sleep(POLL_S)
        except _Dead:
            # give the log a moment to receive the traceback
            await asyncio.sleep(0.3)
            reason = engine.exit_reason()
            view.failed(engine.name, reason)
            raise ReadinessError(engine.name, ph.label, budget, reason, engine.log_tail()) from None
        except asyncio.TimeoutError:
            reason = f"not reached within {budget:g} s (last: {last})"
            view.failed(engine.name, reason)
            raise ReadinessError(engine.name, ph.label, budget, reason, engine.log_tail()) from None
        except _Fatal as e:
            view.failed(engine.name, str(e))
            raise ReadinessError(engine.name, ph.label, budget, str(e), engine.log_tail()) from None
        info.phase_s[ph.label] = time.monotonic() - t0
    _admit_fixes(engine, allow_unfixed, info, view)
    view.admitted(engine.name, time.monotonic() - t_all)
    return info


def _admit_fixes(engine, allow_unfixed: bool, info: ReadyInfo, view) -> None:
    """Refuse an engine whose report shows a needed fix not good, unless `rollout.allow_unfixed`."""
    reason = fix_refusal(engine.name, info.server_info, allow_unfixed)
    if reason is None:
        return
    view.failed(engine.name, reason)
    raise ReadinessError(engine.name, "fix report", 0, reason, engine.log_tail())


def fix_refusal(name: str, server_info, allow: bool, switch: str = "rollout.allow_unfixed: true") -> Optional[str]:
    """Why the engine `name` with this `/server_info` must not be admitted (one line), or None. With
    `allow` (the override, named by `switch`) it is admitted anyway and one stderr line says so."""
    why = fix_problem(server_info)
    if why is None:
        return None
    if allow:
        print(f"{name}: admitted WITHOUT its fixes ({switch}): {why}"[:400], file=sys.stderr, flush=True)
        return None
    return f"refused: {why} (set {switch} to run it anyway)"


async def _health_hedged(client: EngineClient, engine, deadline, max_inflight: int = 5) -> tuple[bool, str]:
    """/health_generate answers only on SGLang's 1 s ticks after a one-token generation, so a new
    probe starts every POLL_S while earlier ones are pending (at most max_inflight): the first 200 wins."""
    pending: set = set()
    last = "no answer yet"
    try:
        while True:
            if len(pending) < max_inflight:
                pending.add(asyncio.ensure_future(client.health_generate(engine, _left(deadline))))
            done, pending = await asyncio.wait(pending, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                try:
                    t.result()
                except EngineUnreachable as e:
                    last = short_error(e.cause)
                    continue
                except ApiKeyRejected:
                    raise
                except EngineRejected as e:
                    last = f"HTTP {e.status} on /health_generate"
                    continue
                return True, "ok"
            if time.monotonic() >= deadline:
                return False, last
            if done:  # answers came back (e.g. 503 while starting): pace the next ones
                await asyncio.sleep(POLL_S)
    finally:
        for t in pending:
            t.cancel()


async def _read_dp_size(client: EngineClient, engine, info: ReadyInfo, deadline) -> None:
    """DP ranks from /server_info (a scheduler round trip, so not on the path to /health_generate);
    the spec's dp stays when the engine does not answer it usably."""
    try:
        info.server_info = await client.server_info(engine, _left(deadline))
        info.dp_size = dp_ranks(info.server_info)
    except ApiKeyRejected:
        raise
    except (EngineRejected, ValueError, TypeError, AttributeError):
        pass


class _Fatal(Exception):
    """A phase answer that waiting will not fix (e.g. the API key is rejected)."""


async def _check(key, client: EngineClient, engine, info: ReadyInfo, deadline) -> tuple[bool, str]:
    if key == "process":
        return engine.alive(), "process not running"
    if key == "http":
        try:
            info.weight_version = (await client.model_info(engine, _left(deadline))).get("weight_version")
        except ApiKeyRejected:
            raise
        except EngineRejected as e:
            if e.status == 200:   # up, but no JSON: the weight version stays unknown
                return True, "ok"
            return False, f"HTTP {e.status} on /model_info"
        return True, "ok"
    if key == "server_up":
        try:
            await client.ready(engine, _left(deadline))
        except EngineRejected as e:
            if e.status == 404:   # SGLang 0.5.15.post1 / 0.5.16 have no /ready; their /health_generate answers
                return True, "no /ready route"   # 503 while the server status is Starting (the next phase)
            return False, f"HTTP {e.status} on /ready (server status not Up)"
        return True, "ok"
    if key == "health_generate":
        return await _health_hedged(client, engine, deadline)
    if key == "dp_probe":
        await _read_dp_size(client, engine, info, deadline)
        ranks = list(range(info.dp_size))
        left = max(0.5, deadline - time.monotonic())
        results = await asyncio.gather(*(probe_dp_rank(client, engine, r, left) for r in ranks),
                                       return_exceptions=True)
        rejected = [r for r in results if isinstance(r, ApiKeyRejected)]
        if rejected:
            raise rejected[0]
        bad = [_rank_failure(r, rank) for rank, r in zip(ranks, results) if isinstance(r, BaseException)]
        wrong = [str(r) for r in results if isinstance(r, WrongRank)]
        if wrong:
            raise _Fatal("; ".join(wrong)[:200])   # routing is wrong: waiting will not fix it
        info.rank_answers = dict(zip(ranks, results))
        return not bad, "; ".join(bad)[:200] or "ok"
    raise ValueError(key)


def _rank_failure(e: BaseException, rank: int) -> str:
    """Why one rank's probe failed, one short line."""
    if isinstance(e, EngineRejected):
        return f"DP rank {rank}: HTTP {e.status} {e.body[:200]}".replace("\n", " ")
    if isinstance(e, EngineUnreachable):
        return f"DP rank {rank}: {short_error(e.cause)}"
    return str(e) if isinstance(e, (NoToken, WrongRank)) else f"DP rank {rank}: {short_error(e)}"
