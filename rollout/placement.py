"""Group placement: every sample of a GRPO group on one (engine, DP rank), ranks balanced by tokens.

Each attention-DP rank of an SGLang engine has its own radix cache and KV pool, and SGLang's DP
controller picks a rank per request without looking at prefixes (round robin, requests or tokens), so
a group sent sample by sample is prefilled on up to n ranks. Here a group is placed when its first
sample asks, on the rank free first (then the least served): the least of the tokens its answered
attempts were charged (`level`) plus its predicted load (each placed group's prompt once, plus every
unanswered sample's remaining budget), so the sum is what the rank was given, whatever has been answered
yet. With DP attention the ranks step together, so the rank with the most work left sets the step's
time, and every busy rank has advanced as far as the others: the total a rank was given says which
finishes first, where the predicted load alone counts an attempt half done as not started. A rank found
idle is raised to the furthest any rank's clock reached (the time it idled is lost, not owed, so it is
not flooded). Least first keeps the maximum low (min-max). A group larger than one rank should hold
(the engine's concurrency over its DP ranks) goes over the fewest ranks. The group's whole load is
reserved at once (each sibling's own budget replaces its share as it takes its seat), so groups placed
together spread out; a (re-)admitted rank starts level with the others. A sample
carries its (engine, rank) in `sample.engines[-1]` / `sample.dp_rank`: a continued (aborted or partial)
or re-sent sample goes back there while the engine is admitted, unless that rank's load exceeds the
least loaded one's by more than the sample's tokens (what it prefills again elsewhere) and its own load
(so the move leaves the other rank below it): then it moves there; once an engine is removed, or fails
a connection, its groups are placed again, together, on the others.

The rank goes in the /generate body as `routed_dp_rank`: every reviewed SGLang (0.5.15.post1 ..
0.5.23) has that field in `GenerateReqInput` and its DP controller sends such a request to that
rank; the tokenizer refuses a rank out of range; 0.5.18 and later also take the deprecated alias
`data_parallel_rank`; the `X-Data-Parallel-Rank` header is not honoured (sglang#38729). Readiness
probes every rank pinned this way and refuses an engine that answers from another rank; an engine
with one rank gets no `routed_dp_rank`.

Prefill once: samples that reach a rank together are prefilled together in one batch before the
cache holds their prompt (SGLang's default `fcfs` policy checks no in-batch prefix), so a fresh
group's samples wait for one zero-token request of the prompt on their rank (what SGLang's own
parallel sampling does), holding no engine slot meanwhile (the dispatcher sends the primer outside the
slots, one request per fresh group beyond them, so the slots serve other samples); a primer that
fails, or whose engine is removed, is not retried, the samples go anyway. Without word of
a group the first sample decides one loop tick after it is placed (siblings started with it have taken
their seats); a caller whose samples arrive one request at a time (slime's custom generate functions,
through the loopback front) announces the group with `expect` first, so its first request primes.
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
    outstanding: int = 0     # predicted load: tokens reserved or in flight (prompts once + remaining budgets)
    served: int = 0          # tokens prefilled or generated here (answers' uncached prompt + completion, primers)
    level: int = 0           # predicted tokens of answered attempts, on the ranks' common clock: raised to
                             # the most any rank reached when found idle
    requests: int = 0


class _Placed:
    """One group's seats: target -> samples still to come there, what each seat reserved; the primer of
    each target."""

    def __init__(self, seats: dict, cost: int, prompt: int):
        self.seats, self.cost, self.prompt = seats, cost, prompt
        self.sizes = dict(seats)     # samples placed on each target: a primer only where more than one
        self.primers: dict = {}

    def charge(self, key: Key, cost: int) -> int:
        """The load one sample of `cost` tokens (prompt + budget) adds on `key`: its budget, and its share
        of the prompt the rank prefills once for all of the group's samples there."""
        return max(0, cost - self.prompt) + -(-self.prompt // max(1, self.sizes[key]))


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
        self.primer_at: collections.Counter = collections.Counter()       # key -> tokens its primers prefilled
        self.expected: collections.OrderedDict[str, int] = collections.OrderedDict()   # group id -> samples coming
        self.top = 0                             # the most any rank's `level` reached

    # ---------------------------------------------------------------- engines
    def admit(self, engine: str, dp_ranks: Optional[int]) -> None:
        """An engine was admitted (the pool's engine table calls this, and `remove` when it is lost)."""
        n = max(1, int(dp_ranks or 1))
        self.remove(engine)
        self.dp[engine] = n
        start = sum(v.served for v in self.ranks.values()) // max(1, len(self.ranks))
        for r in range(n):   # a (re-)admitted rank starts level with the others, so it is not flooded
            self.ranks[(engine, r)] = RankLoad(served=start, level=self.top)

    def remove(self, engine: str) -> None:
        for r in range(self.dp.pop(engine, 0)):
            self.ranks.pop((engine, r), None)

    def rank_param(self, key: Key) -> Optional[int]:
        """The `routed_dp_rank` to send for `key`, or None (one rank: the engine picks)."""
        return key[1] if self.dp.get(key[0], 1) > 1 else None

    # ---------------------------------------------------------------- placing
    def expect(self, group_id: str, samples: int) -> None:
        """`samples` of group `group_id` will ask, though maybe not in the same loop tick."""
        self.expected.pop(group_id, None)
        self.expected[group_id] = samples
        while len(self.expected) > self.max_groups:
            self.expected.popitem(last=False)

    def place(self, sample, cost: int, avoid=()) -> Optional[Key]:
        """The admitted (engine, rank) of `sample`'s next attempt (None when no engine is admitted).
        Asked again before the attempt is sent it gives the same answer while that engine is admitted;
        `done` ends the attempt. `cost`: the attempt's tokens (its tokens so far + remaining budget). `avoid`:
        engines that just failed a connection (treated as removed, as today's routing skips them)."""
        held = self.current.get(sample.sample_id)
        if held is not None:
            if held[0] in self.ranks and held[0][0] not in avoid:
                return held[0]
            self.done(sample)
        self._avoid = avoid
        key, charge, seated = self._choose(sample, cost)
        if key is not None:
            if not seated:
                self.ranks[key].outstanding += charge
            self.current[sample.sample_id] = (key, charge, sample.group_id if seated else None)
            sample.dp_rank = key[1]
        return key

    def _choose(self, sample, cost: int) -> tuple:
        """(key, charge, seated): where the attempt goes and the load it adds there."""
        own = (sample.engine, getattr(sample, "dp_rank", None))
        if own[0] is not None and self._ok(own):
            self._lift(own)
            least = min((k for k in self.ranks if self._ok(k)), key=lambda k: self.ranks[k].outstanding)
            if self.ranks[own].outstanding - self.ranks[least].outstanding > sample.num_tokens + cost:
                return least, cost, False          # a continued sample whose rank fell behind: re-balanced
            return own, cost, False                # a continued or re-sent sample: back to its rank
        group = self.groups.get(sample.group_id)
        if group is not None:
            for k in [k for k in group.seats if not self._ok(k)]:
                self._unseat_one(group, k)         # its engine was removed: the group is placed again
            if not group.seats:
                group = None
        if group is None:
            group = self._new_group(sample, cost)
            if group is None:
                return None, 0, False
        key = max(group.seats, key=lambda k: group.seats[k])
        if group.seats[key] > 0:
            group.seats[key] -= 1                  # its share was reserved with the group
            charge = group.charge(key, cost)
            self.ranks[key].outstanding += charge - group.charge(key, group.cost)
            return key, charge, True
        return key, cost, False

    def _ok(self, key: Key) -> bool:
        return key in self.ranks and key[0] not in self._avoid

    def _lift(self, key: Key) -> None:
        """An idle rank lost the time it idled (the ranks step together): it starts from the common clock
        (the furthest any rank's `level` reached), not behind it."""
        load = self.ranks[key]
        if load.outstanding <= 0:
            load.level = max(load.level, self.top)

    def _unseat_one(self, group: _Placed, key: Key) -> None:
        if key in self.ranks:
            self.ranks[key].outstanding -= group.seats[key] * group.charge(key, group.cost)
        del group.seats[key]

    def _new_group(self, sample, cost: int) -> Optional[_Placed]:
        keys = [k for k in self.ranks if self._ok(k)]
        if not keys:
            return None
        per_rank = max(1, min(self.capacity // self.dp[k[0]] for k in keys))
        n = self.expected.get(sample.group_id) or self.group_size
        parts = min(len(keys), math.ceil(n / per_rank))
        # min-max: the least work on the common clock (what the rank was given), then the least served
        load = self.ranks
        for k in keys:
            self._lift(k)
        best = sorted(keys, key=lambda k: (load[k].level + load[k].outstanding, load[k].served))[:parts]
        seats = {k: n // parts + (i < n % parts) for i, k in enumerate(best)}
        placed = _Placed(seats, cost, min(cost, len(sample.prompt_ids)))
        for k, s in seats.items():
            self.ranks[k].outstanding += s * placed.charge(k, cost)
        self.groups.pop(sample.group_id, None)
        self.groups[sample.group_id] = placed
        while len(self.groups) > self.max_groups:
            _, old = self.groups.popitem(last=False)
            self._unseat(old)
        return placed

    def _unseat(self, group: _Placed) -> None:
        """Release the reservation of seats no sample took (they are not coming)."""
        for k, s in group.seats.items():
            if k in self.ranks:
                self.ranks[k].outstanding -= s * group.charge(k, group.cost)
            group.seats[k] = 0

    def done(self, sample, served_tokens: int = 0) -> None:
        """`sample`'s attempt ended: its cost is released, `served_tokens` (what it prefilled uncached and
        generated) counted on its rank. The first attempt of a group to end also releases the seats its
        siblings did not take."""
        held = self.current.pop(sample.sample_id, None)
        if held is None:
            return
        key, cost, gid = held
        load = self.ranks.get(key)
        if load is not None:
            load.outstanding -= cost
            load.requests += 1
            load.served += served_tokens
            load.level += cost           # what the attempt was charged moves to the clock: the sum stays exact
            self.top = max(self.top, load.level)
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
                coming = group.sizes[key] if self.expected.get(sample.group_id, 0) >= 2 else \
                    group.sizes[key] - group.seats.get(key, 0)
                if coming >= 2:                  # a lone sample needs no primer
                    await self._prime(prime, key)
            finally:
                sent.set()
        else:
            await sent.wait()

    async def _prime(self, prime, key: Key) -> None:
        try:
            meta = await prime()
            self.primed += 1
            new = int(meta.get("prompt_tokens", 0)) - int(meta.get("cached_tokens", 0))
            self.primer_prefilled += new
            self.primer_at[key] += new
            if key in self.ranks:
                self.ranks[key].served += new
        except EngineError:   # the samples go anyway, prefilled once each at worst
            self.primer_failures += 1
