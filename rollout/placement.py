"""Group placement: every sample of a GRPO group on one (engine, DP rank), ranks balanced by tokens.

Each attention-DP rank of an SGLang engine has its own radix cache and KV pool, and SGLang's DP
controller picks a rank per request without looking at prefixes (round robin, requests or tokens), so
a group sent sample by sample is prefilled on up to n ranks. Here a group is placed when its first
sample asks, by tokens: outstanding ones (prompt + remaining budget of every sample placed on a rank and
not yet answered) plus those the rank served, so the step's work evens out, among the ranks that have
less than a full rank's worth of tokens outstanding over the least (a rank that falls behind gets no
more); a group larger than one rank should hold (the engine's concurrency over its DP ranks) goes over
the fewest ranks. The group's whole cost is reserved at once, so groups placed together spread out; a
(re-)admitted rank starts level with the others. A sample carries its (engine, rank) in
`sample.engines[-1]` / `sample.dp_rank`: a continued (aborted or partial) or re-sent sample goes back
there while the engine is admitted; once an engine is removed, or fails a connection, its groups are
placed again, together, on the others.

The rank goes in the /generate body as `routed_dp_rank`: every reviewed SGLang (0.5.15.post1 ..
0.5.23) has that field in `GenerateReqInput` and its DP controller sends such a request to that
rank; the tokenizer refuses a rank out of range; 0.5.18 and later also take the deprecated alias
`data_parallel_rank`; the `X-Data-Parallel-Rank` header is not honoured (sglang#38729). Readiness
probes every rank pinned this way and refuses an engine that answers from another rank; an engine
with one rank gets no `routed_dp_rank`.

Prefill once: samples that reach a rank together are prefilled together in one batch before the
cache holds their prompt (SGLang's default `fcfs` policy checks no in-batch prefix), so a fresh
group's samples wait for one zero-token request of the prompt on their rank (what SGLang's own
parallel sampling does); a primer that fails is not retried, the samples go anyway.
"""
from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from rollout.errors import EngineError

Key = tuple   # (engine name, DP rank)


@dataclass
class RankLoad:
    outstanding: int = 0     # tokens reserved or in flight (prompt + remaining budget)
    served: int = 0          # tokens of answered attempts (prompt + generated)
    requests: int = 0


class _Placed:
    """One group's seats: target -> samples still to come there; the primer of each target."""

    def __init__(self, seats: dict, cost: int):
        self.seats, self.cost = seats, cost
        self.sizes = dict(seats)     # samples placed on each target: a primer only where more than one
        self.primers: dict = {}


class Placement:
    def __init__(self, group_size: int, capacity: int, max_groups: int = 4096):
        self.group_size, self.capacity = max(1, group_size), max(1, capacity)
        self.ranks: dict[Key, RankLoad] = {}
        self.dp: dict[str, int] = {}             # engine -> its DP ranks, as the engine table announced them
        self.groups: collections.OrderedDict[str, _Placed] = collections.OrderedDict()
        self.max_groups = max_groups
        self._avoid = ()
        self.current: dict[str, tuple] = {}      # sample id -> (key, cost, group id if seated) of its attempt
        self.primed = self.primer_failures = self.primer_prefilled = 0   # primers sent, failed; tokens they prefilled

    # ---------------------------------------------------------------- engines
    def admit(self, engine: str, dp_ranks: Optional[int]) -> None:
        """An engine was admitted (the pool's engine table calls this, and `remove` when it is lost)."""
        n = max(1, int(dp_ranks or 1))
        self.remove(engine)
        self.dp[engine] = n
        start = sum(v.served for v in self.ranks.values()) // max(1, len(self.ranks))
        for r in range(n):   # a (re-)admitted rank starts level with the others, so it is not flooded
            self.ranks[(engine, r)] = RankLoad(served=start)

    def remove(self, engine: str) -> None:
        for r in range(self.dp.pop(engine, 0)):
            self.ranks.pop((engine, r), None)

    def rank_param(self, key: Key) -> Optional[int]:
        """The `routed_dp_rank` to send for `key`, or None (one rank: the engine picks)."""
        return key[1] if self.dp.get(key[0], 1) > 1 else None

    # ---------------------------------------------------------------- placing
    def place(self, sample, cost: int, avoid=()) -> Optional[Key]:
        """The admitted (engine, rank) of `sample`'s next attempt (None when no engine is admitted).
        Asked again before the attempt is sent it gives the same answer while that engine is admitted;
        `done` ends the attempt. `cost`: the attempt's tokens (prompt + remaining budget). `avoid`:
        engines that just failed a connection (treated as removed, as today's routing skips them)."""
        held = self.current.get(sample.sample_id)
        if held is not None:
            if held[0] in self.ranks and held[0][0] not in avoid:
                return held[0]
            self.done(sample)
        self._avoid = avoid
        key, seated = self._choose(sample, cost)
        if key is not None:
            if not seated:
                self.ranks[key].outstanding += cost
            self.current[sample.sample_id] = (key, cost, sample.group_id if seated else None)
            sample.dp_rank = key[1]
        return key

    def _choose(self, sample, cost: int) -> tuple:
        own = (sample.engine, getattr(sample, "dp_rank", None))
        if own[0] is not None and self._ok(own):
            return own, False                      # a continued or re-sent sample: back to its rank
        group = self.groups.get(sample.group_id)
        if group is not None:
            for k in [k for k in group.seats if not self._ok(k)]:
                self._unseat_one(group, k)         # its engine was removed: the group is placed again
            if not group.seats:
                group = None
        if group is None:
            group = self._new_group(sample.group_id, cost)
            if group is None:
                return None, False
        key = max(group.seats, key=lambda k: group.seats[k])
        if group.seats[key] > 0:
            group.seats[key] -= 1                  # its cost was reserved with the group
            return key, True
        return key, False

    def _ok(self, key: Key) -> bool:
        return key in self.ranks and key[0] not in self._avoid

    def _unseat_one(self, group: _Placed, key: Key) -> None:
        if key in self.ranks:
            self.ranks[key].outstanding -= group.seats[key] * group.cost
        del group.seats[key]

    def _new_group(self, gid: str, cost: int) -> Optional[_Placed]:
        keys = [k for k in self.ranks if self._ok(k)]
        if not keys:
            return None
        per_rank = max(1, min(self.capacity // self.dp[k[0]] for k in keys))
        n = self.group_size
        parts = min(len(keys), math.ceil(n / per_rank))
        # the fewest tokens placed (served + outstanding: the step's balance, not only the moment's), among
        # ranks with less than a full rank's worth of tokens outstanding over the least (a slow rank waits)
        load = self.ranks
        near = min(load[k].outstanding for k in keys) + per_rank * cost
        best = sorted(keys, key=lambda k: (load[k].outstanding > near, load[k].outstanding + load[k].served))[:parts]
        seats = {k: n // parts + (i < n % parts) for i, k in enumerate(best)}
        for k, s in seats.items():
            self.ranks[k].outstanding += s * cost
        self.groups.pop(gid, None)
        self.groups[gid] = placed = _Placed(seats, cost)
        while len(self.groups) > self.max_groups:
            _, old = self.groups.popitem(last=False)
            self._unseat(old)
        return placed

    def _unseat(self, group: _Placed) -> None:
        """Release the reservation of seats no sample took (they are not coming)."""
        for k, s in group.seats.items():
            if k in self.ranks:
                self.ranks[k].outstanding -= s * group.cost
            group.seats[k] = 0

    def done(self, sample, served_tokens: int = 0) -> None:
        """`sample`'s attempt ended: its cost is released, `served_tokens` counted on its rank. The
        first attempt of a group to end also releases the seats its siblings did not take."""
        held = self.current.pop(sample.sample_id, None)
        if held is None:
            return
        key, cost, gid = held
        load = self.ranks.get(key)
        if load is not None:
            load.outstanding -= cost
            load.served += served_tokens
            load.requests += 1
        group = self.groups.get(gid) if gid else None
        if group is not None:
            self._unseat(group)

    # ---------------------------------------------------------------- prefill once
    async def primed_once(self, sample, key: Key, prime: Callable[[], Awaitable[None]]) -> None:
        """Wait for the one zero-token request of a fresh group's prompt on `key` (sent by the first
        sample there). A continued sample, or one whose group was placed again, does not wait."""
        group = self.groups.get(sample.group_id)
        if group is None or sample.response_ids or group.sizes.get(key, 0) < 2:
            return
        sent = group.primers.get(key)
        if sent is None:                         # the first sample there sends it, the others wait
            sent = group.primers[key] = asyncio.Event()
            try:
                await asyncio.sleep(0)           # siblings started with it take their seats first
                if group.sizes[key] - group.seats.get(key, 0) >= 2:   # a lone sample needs no primer
                    await self._prime(prime)
            finally:
                sent.set()
        else:
            await sent.wait()

    async def _prime(self, prime) -> None:
        try:
            meta = await prime()
            self.primed += 1
            self.primer_prefilled += int(meta.get("prompt_tokens", 0)) - int(meta.get("cached_tokens", 0))
        except EngineError:   # the samples go anyway, prefilled once each at worst
            self.primer_failures += 1
