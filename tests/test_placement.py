"""Group placement (rollout/placement.py): a group on one (engine, DP rank), ranks by their work on
the common clock, big groups over the fewest ranks, continued samples back to their rank, a lost engine's groups placed
again together, the prompt primed once; and the dispatcher sending `routed_dp_rank` and the primer."""
import asyncio
import collections

import pytest
from aiohttp import web

from rollout.dispatch import Dispatcher
from rollout.engines.client import EngineClient
from rollout.placement import Placement
from rollout.types import Group, Sample, SampleStatus
from support.fake_sglang import Loopback

pytestmark = pytest.mark.timeout(60)


def _group(gid, n, prompt_len=10):
    return Group.fresh(gid, list(range(prompt_len)), n).samples


def _placement(engines=2, dp=2, n=8, capacity=64):
    p = Placement(n, capacity)
    for e in range(engines):
        p.admit(f"e{e}", dp)
    return p


def test_each_group_on_one_rank_and_groups_spread():
    p = _placement()
    keys = [{p.place(s, 26) for s in _group(f"g{i}", 8)} for i in range(4)]
    assert all(len(k) == 1 for k in keys)
    assert {k.pop() for k in keys} == {("e0", 0), ("e0", 1), ("e1", 0), ("e1", 1)}


def test_rank_by_outstanding_tokens_not_requests():
    p = _placement(engines=1, dp=2, n=1)
    long = Sample("a/0", "a", 0, list(range(900)))
    assert p.place(long, 1000) == ("e0", 0)
    for i in range(3):
        assert p.place(Sample(f"b{i}/0", f"b{i}", 0, [1]), 30) == ("e0", 1)
    assert p.place(Sample("c/0", "c", 0, [1]), 30) == ("e0", 1)   # 90 tokens < 1000, though 3 requests > 1


def test_a_group_larger_than_a_rank_holds_goes_over_the_fewest_ranks():
    p = _placement(engines=2, dp=2, n=10, capacity=8)        # a rank should hold 8 / 2 = 4
    got = collections.Counter(p.place(s, 20) for s in _group("g", 10))
    assert sorted(got.values()) == [3, 3, 4] and len(got) == 3


def test_continued_sample_returns_to_its_rank_and_a_lost_engine_group_moves_together():
    p = _placement()
    samples = _group("g", 8)
    first = {p.place(s, 26) for s in samples}
    (key,) = first
    for s in samples:
        p.done(s, 20)
        s.engines.append(key[0])
        s.status = SampleStatus.ABORTED
    p.place(Sample("x/0", "x", 0, [1]), 5)           # another group in between
    assert {p.place(s, 26) for s in samples[:2]} == {key}    # back to its rank while admitted
    for s in samples[:2]:
        p.done(s)
    p.remove(key[0])
    moved = {p.place(s, 26) for s in samples}
    assert len(moved) == 1 and moved.pop()[0] != key[0]       # together, elsewhere, once


def test_reservations_are_released():
    p = _placement(n=8)
    samples = _group("g", 8)
    for s in samples[:6]:                            # two samples never ask (e.g. the batch filled)
        p.place(s, 26)
    for s in samples[:6]:
        p.done(s, 30)
    assert all(v.outstanding == 0 for v in p.ranks.values())
    assert sum(v.served for v in p.ranks.values()) == 180


def test_dp_rank_sent_only_where_an_engine_has_ranks():
    p = Placement(2, 8)
    p.admit("one", 1)
    p.admit("two", 2)
    assert p.rank_param(("one", 0)) is None and p.rank_param(("two", 1)) == 1


def test_primer_once_per_rank_not_for_continued_samples_or_single_seats():
    async def go():
        p = _placement(n=4)
        calls = []

        async def prime():
            calls.append(1)
            await asyncio.sleep(0.01)
            return {"prompt_tokens": 10, "cached_tokens": 0}
        samples = _group("g", 4)
        keys = [p.place(s, 20) for s in samples]
        await asyncio.gather(*(p.primed_once(s, k, prime) for s, k in zip(samples, keys)))
        cont = samples[0]
        cont.response_ids = [5]
        await p.primed_once(cont, keys[0], prime)
        single = Placement(1, 8)
        single.admit("e", 2)
        s1 = _group("h", 1)[0]
        await single.primed_once(s1, single.place(s1, 5), prime)
        return calls, p
    calls, p = asyncio.run(go())
    assert calls == [1] and p.primed == 1 and p.primer_prefilled == 10


# ---------------------------------------------------------------- through the dispatcher


class _Eng:
    def __init__(self, name, port):
        self.name, self.url, self.api_key = name, f"http://127.0.0.1:{port}", None


def _answer(body, n):
    """SGLang's /generate answer of `n` tokens for `body`, on the rank it was pinned to."""
    return web.json_response({"meta_info": {
        "output_token_logprobs": [[-1.0, 7, None]] * n, "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": len(body["input_ids"]), "cached_tokens": 0, "completion_tokens": n,
        "dp_rank": body.get("routed_dp_rank")}})


async def _engine(log, answered=None):
    async def generate(request):
        body = await request.json()
        log.append((asyncio.get_running_loop().time(), body))
        n = body["sampling_params"]["max_new_tokens"]
        await asyncio.sleep(0.02)
        if answered is not None:
            answered.append((asyncio.get_running_loop().time(), n))
        return _answer(body, n)
    server = await Loopback({"/generate": generate}).serve()
    return server, server.port


def _dispatch(placement, answered=None):
    async def go():
        log = []
        runner, port = await _engine(log, answered)
        try:
            async with EngineClient() as client:
                d = Dispatcher(client, {"max_new_tokens": 3}, capacity=8, placement=placement)
                await d.admit(_Eng("e0", port), dp_ranks=2)
                samples = _group("g", 4)
                await asyncio.gather(*(d.run(s) for s in samples))
                return log, samples
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_dispatcher_pins_the_group_and_sends_the_primer_first():
    answered = []
    log, samples = _dispatch(Placement(4, 8), answered)
    primers = [(t, b) for t, b in log if b["sampling_params"]["max_new_tokens"] == 0]
    sent = [(t, b) for t, b in log if b["sampling_params"]["max_new_tokens"] > 0]
    assert len(primers) == 1 and len(sent) == 4
    assert {b["routed_dp_rank"] for _, b in log} == {primers[0][1]["routed_dp_rank"]}
    primer_answered = [t for t, n in answered if n == 0]
    assert min(t for t, _ in sent) >= primer_answered[0]       # after the primer's answer
    assert {s.dp_rank for s in samples} == {primers[0][1]["routed_dp_rank"]}
    assert all(s.status is SampleStatus.TRUNCATED for s in samples)


def test_per_sample_routing_sends_no_rank_and_no_primer():
    log, _ = _dispatch(None)
    assert len(log) == 4 and all("routed_dp_rank" not in b for _, b in log)


def test_an_engine_that_just_failed_a_connection_is_avoided_and_the_group_moves_together():
    p = _placement(engines=2, dp=1)
    samples = _group("g", 8)
    (key,) = {p.place(s, 26) for s in samples}
    for s in samples:
        p.done(s)
        s.engines.append(key[0])          # every attempt failed at the connection level there
    moved = {p.place(s, 26, avoid={key[0]}) for s in samples}
    assert len(moved) == 1 and moved.pop()[0] != key[0]
    held = _group("h", 1)[0]
    (k2,) = {p.place(held, 5)}
    assert p.place(held, 5, avoid={k2[0]})[0] != k2[0]     # a placed, unsent attempt moves too


def test_a_new_group_goes_to_the_rank_free_first_on_the_common_clock():
    """The ranks step together, so a rank's work left is what it was given less what every rank has done
    meanwhile. r0 got a group of 2 x 600 tokens, r1 one of 2 x 400, at once; r0's first sample is answered
    (600 tokens). r0 has less outstanding (600 < 800), but r1 is free first (800 - 600 < 1,200 - 600):
    the next group goes to r1 (1,100 and 1,200 given), not to r0 (1,500 against 800)."""
    p = _placement(engines=1, dp=2, n=2)
    big, small = _group("big", 2, prompt_len=1), _group("small", 2, prompt_len=1)
    assert {p.place(s, 600) for s in big} == {("e0", 0)}
    assert {p.place(s, 400) for s in small} == {("e0", 1)}
    p.done(big[0], 600)
    assert p.ranks[("e0", 0)].outstanding < p.ranks[("e0", 1)].outstanding
    nxt = {p.place(s, 150) for s in _group("next", 2, prompt_len=1)}
    assert nxt == {("e0", 1)}, f"the next group went to {nxt}: the least outstanding, not the rank free first"


def test_a_primed_prompt_counts_once_on_its_rank():
    """r0 was given a prompt of 1,000 tokens once and 2 x 10 new tokens (1,020), r1 a prompt of 10 and
    2 x 600 (1,210). r0's primer has answered (1,000 tokens prefilled), its samples have not: the prompt
    is still one prompt, so the next group goes to r0, not to r1 as if r0 had 2,020."""
    async def go():
        p = _placement(engines=1, dp=2, n=2)
        big, small = _group("big", 2, prompt_len=1000), _group("small", 2, prompt_len=10)
        keys = {p.place(s, 1010) for s in big}
        assert keys == {("e0", 0)} and {p.place(s, 610) for s in small} == {("e0", 1)}

        async def prime():
            return {"prompt_tokens": 1000, "cached_tokens": 0}
        await asyncio.gather(*(p.primed_once(s, ("e0", 0), prime) for s in big))
        assert p.primed == 1
        return {p.place(s, 20) for s in _group("next", 2, prompt_len=10)}
    got = asyncio.run(go())
    assert got == {("e0", 0)}, f"the next group went to {got}: r0's primed prompt was counted twice"


def test_an_idle_rank_is_not_owed_the_time_it_idled():
    """A rank that idled while another served 1,000 tokens lost that time: two groups placed together
    afterwards go one to each rank, not both to the idle one to 'catch up' (which would leave the other
    rank idle while it works through both)."""
    p = _placement(engines=2, dp=1, n=1)
    s = Sample("w/0", "w", 0, [1])
    assert p.place(s, 1000) == ("e0", 0)
    p.done(s, 1000)
    got = [p.place(Sample(f"g{i}/0", f"g{i}", 0, [1]), 100) for i in range(2)]
    assert sorted(got) == [("e0", 0), ("e1", 0)], f"groups placed on {got}: the idle rank was flooded"


def test_balance_over_the_step_and_a_readmitted_engine_is_not_flooded():
    p = _placement(engines=2, dp=1, n=1)
    for i, cost in enumerate((900, 100, 100, 100)):       # e1 gets the short ones, e0 the long one
        s = Sample(f"g{i}/0", f"g{i}", 0, [1])
        p.place(s, cost)
        p.done(s, cost)
    assert {k: v.served for k, v in p.ranks.items()} == {("e0", 0): 900, ("e1", 0): 300}
    s = Sample("x/0", "x", 0, [1])
    assert p.place(s, 50) == ("e1", 0)                    # nothing outstanding anywhere: the least served
    p.remove("e1")
    p.admit("e1", 1)                                      # restarted: level with the others
    assert p.ranks[("e1", 0)].served == 900


def test_a_waiting_sibling_cancelled_does_not_cancel_the_others():
    async def go():
        p = _placement(engines=1, dp=1, n=3)
        gate = asyncio.Event()

        async def prime():
            await gate.wait()
            return {}
        samples = _group("g", 3)
        keys = [p.place(s, 20) for s in samples]
        tasks = [asyncio.create_task(p.primed_once(s, k, prime)) for s, k in zip(samples, keys)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()
        await asyncio.sleep(0.01)
        assert not tasks[2].done()                 # still waits for the primer
        gate.set()
        await asyncio.gather(tasks[0], tasks[2])
        return tasks[1].cancelled()
    assert asyncio.run(go())


def test_sglang_takes_routed_dp_rank_in_the_body():
    """Guard (the SGLang installed here): `routed_dp_rank` is a /generate body field that reaches the DP
    controller, which routes on it. Every reviewed release spells it so (0.5.15.post1 .. 0.5.23)."""
    import inspect

    io = pytest.importorskip("sglang.srt.managers.io_struct")
    dpc = pytest.importorskip("sglang.srt.managers.data_parallel_controller")
    req = io.GenerateReqInput(input_ids=[1, 2], routed_dp_rank=1)
    req.normalize_batch_and_arguments()
    assert req.routed_dp_rank == 1
    assert "routed_dp_rank" in inspect.getsource(io.TokenizedGenerateReqInput)
    assert "req.routed_dp_rank" in inspect.getsource(dpc.DataParallelController)


def test_a_lone_sample_of_a_group_sends_no_primer():
    """One sample outside any group (`RolloutManager.generate`, slime's custom generate): no primer."""
    async def go():
        calls = []

        async def prime():
            calls.append(1)
            return {}
        p = _placement(n=8)
        s = _group("solo", 8)[0]
        await p.primed_once(s, p.place(s, 20), prime)
        return calls
    assert asyncio.run(go()) == []


def test_an_announced_group_primes_though_its_siblings_ask_later():
    """slime's custom generate functions: each sample's first turn reaches the loopback front as its own
    request, so the siblings take their seats after the first one's tick. Announced with `expect`, the
    first request primes and the late siblings wait for that primer; unannounced (the rule for a lone
    sample) the first found no sibling seated and sent none, and every sibling was prefilled again."""
    async def go(announce):
        calls, held = [], asyncio.Event()

        async def prime():
            calls.append(1)
            await held.wait()                  # the primer's prefill lasts until the test lets it end
            return {"prompt_tokens": 10, "cached_tokens": 0}
        p = _placement(n=4)
        if announce:
            p.expect("g", 4)
        samples = _group("g", 4)
        first = asyncio.create_task(p.primed_once(samples[0], p.place(samples[0], 20), prime))
        for _ in range(3):
            await asyncio.sleep(0)             # the first request's ticks pass before any sibling asks
        late = [asyncio.create_task(p.primed_once(s, p.place(s, 20), prime)) for s in samples[1:]]
        for _ in range(3):
            await asyncio.sleep(0)
        waiting = sum(not t.done() for t in late)
        held.set()
        await asyncio.gather(first, *late)
        return calls, waiting, {s.dp_rank for s in samples}
    calls, waiting, ranks = asyncio.run(go(True))
    assert calls == [1] and waiting == 3 and len(ranks) == 1   # the siblings waited for it, one rank
    assert asyncio.run(go(False))[0] == []                     # the old rule: no primer at all


def test_groups_started_longest_first_leave_the_ranks_level():
    """Placed together in the order given, two small groups then a large one load one rank with 10 + 20 and
    the other with 10 prompt tokens; the manager starts every-group batches longest first (`longest_first`),
    which places the large one alone and the two small ones together: level."""
    def loads(groups):
        p = Placement(2, 64)
        p.admit("e", 2)
        for g in groups:
            for s in g.samples:
                p.place(s, len(s.prompt_ids) + 1)
        return sorted(v.outstanding for v in p.ranks.values())
    groups = [Group.fresh(f"g{i}", list(range(n)), 2) for i, n in enumerate((10, 10, 20))]
    d = Dispatcher(None, {"max_new_tokens": 1}, capacity=64, placement=Placement(2, 64))
    ordered = d.longest_first(groups)
    assert [len(g.prompt_ids) for g in ordered] == [20, 10, 10]
    assert loads(groups) == [12, 34]                 # as given: 10 + 20 on one rank (+ a token per sample)
    assert loads(ordered) == [22, 24]
    assert Dispatcher(None, {}, capacity=8).longest_first(groups) == groups   # per-sample routing: as given


def test_config_switch_keeps_per_sample_routing_and_refuses_other_values(tmp_path):
    import os

    import yaml

    from rollout.manager import RolloutManager
    from training_configs.schema import ConfigError, load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = yaml.safe_load(open(os.path.join(root, "training_configs", "tiny-cpu.yaml")))
    path = tmp_path / "c.yaml"
    for value, placed in (("group", True), ("sample", False)):
        d["rollout"]["group_placement"] = value
        path.write_text(yaml.safe_dump(d))
        mgr = RolloutManager.from_config(load_config(str(path)), None, str(tmp_path))
        assert (mgr.dispatcher.placement is not None) is placed
    d["rollout"]["group_placement"] = "engine"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError, match="rollout.group_placement: 'engine' is not one of 'group' or 'sample'"):
        load_config(str(path))


def test_a_group_prompt_counts_once_and_each_sibling_its_own_budget():
    """Predicted load: a group's prompt once per rank (prefilled once), each sample its own remaining budget."""
    p = _placement(engines=1, dp=2, n=4)
    g = _group("g", 4, prompt_len=400)
    budgets = [10, 10, 10, 200]
    keys = {p.place(s, 400 + b) for s, b in zip(g, budgets)}
    (key,) = keys
    assert p.ranks[key].outstanding == 400 + sum(budgets)      # not 4 x (400 + 10): the prompt once
    other = Sample("h/0", "h", 0, list(range(5)))
    assert p.place(other, 300) != key                          # the next group: the least loaded rank
    for s in g:
        p.done(s, 50)
    assert p.ranks[key].outstanding == 0


def test_a_continued_sample_whose_rank_fell_behind_moves_to_the_least_loaded():
    p = _placement(engines=1, dp=2, n=1)
    s = Sample("a/0", "a", 0, list(range(10)))
    key = p.place(s, 20)
    p.done(s, 20)
    s.engines.append(key[0])
    s.status, s.response_ids = SampleStatus.ABORTED, [1, 2]
    assert p.place(s, 30) == key                                # its rank is not behind: back there (cached)
    p.done(s)
    big = Sample("big/0", "big", 0, [1])
    big.engines.append(key[0])
    big.dp_rank = key[1]
    assert p.place(big, 1000) == key                            # now its rank holds 1,000 tokens more
    assert p.place(s, 30)[1] != key[1]                          # re-balanced: 1,000 > 12 tokens again + 30


async def _held_primer_engine(log, release):
    """An engine whose primers (zero-token requests) answer only once `release` is set."""
    async def generate(request):
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        log.append(("sent", n))
        if n == 0:
            await release.wait()
        log.append(("answered", n))
        return _answer(body, n)
    return await Loopback({"/generate": generate}).serve()


async def _primer_sent(log, budget_s=10.0):
    for _ in range(int(budget_s / 0.01)):
        if ("sent", 0) in log:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"no primer sent in {budget_s:g} s: {log}")


def test_siblings_waiting_for_their_primer_hold_no_slot():
    """An engine of 2 slots; a group of 2 waits for its primer. Another sample is sent meanwhile: the
    waiting siblings hold no slot (they did, and it waited for the primer's prefill with the slots idle)."""
    async def go():
        log, release = [], asyncio.Event()
        server = await _held_primer_engine(log, release)
        try:
            async with EngineClient() as client:
                d = Dispatcher(client, {"max_new_tokens": 2}, capacity=2, placement=Placement(2, 4))
                await d.admit(_Eng("e0", server.port), dp_ranks=2)
                group = [asyncio.create_task(d.run(s)) for s in _group("g", 2)]
                await _primer_sent(log)
                other = Sample("x/0", "x", 0, [1, 2])
                other.max_new_tokens = 3
                try:
                    await asyncio.wait_for(d.run(other), 5)
                except asyncio.TimeoutError:
                    pytest.fail("the other sample waited for a slot held by siblings waiting for their primer")
                release.set()
                await asyncio.gather(*group)
                return log
        finally:
            await server.cleanup()
    log = asyncio.run(go())
    assert log.index(("answered", 3)) < log.index(("answered", 0)) < log.index(("sent", 2))


def test_a_primer_pending_on_a_removed_engine_lets_its_group_go_elsewhere():
    """The primer is cancelled with its engine (`remove`): the group is placed again and served on the
    other engine at once, not after the request timeout."""
    async def go():
        log, release = [], asyncio.Event()
        held, ok = await _held_primer_engine(log, release), await _held_primer_engine([], asyncio.Event())
        try:
            async with EngineClient() as client:
                p = Placement(2, 8)
                d = Dispatcher(client, {"max_new_tokens": 2}, capacity=8, placement=p)
                gone = _Eng("held", held.port)
                await d.admit(gone, dp_ranks=2)
                group = [asyncio.create_task(d.run(s)) for s in _group("g", 2)]
                await _primer_sent(log)
                await d.admit(_Eng("ok", ok.port), dp_ranks=1)
                await d.remove(gone)
                try:
                    done = await asyncio.wait_for(asyncio.gather(*group), 5)
                except asyncio.TimeoutError:
                    pytest.fail("the group waited for a primer on a removed engine")
                return done, p
        finally:
            release.set()
            await held.cleanup()
            await ok.cleanup()
    done, p = asyncio.run(go())
    assert [(s.status, s.engines) for s in done] == [(SampleStatus.TRUNCATED, ["ok"])] * 2
    assert p.primer_failures == 1


def test_primers_are_the_only_requests_beyond_the_slots():
    """A primer goes outside the engine's slots (the siblings wait for it holding none): two groups on an
    engine of one slot have at most that slot's request and the two primers at the engine at once."""
    async def go():
        now, most = [0], [0]

        async def generate(request):
            body = await request.json()
            n = body["sampling_params"]["max_new_tokens"]
            now[0] += 1
            most[0] = max(most[0], now[0])
            await asyncio.sleep(0.05)
            now[0] -= 1
            return _answer(body, n)
        server = await Loopback({"/generate": generate}).serve()
        try:
            async with EngineClient() as client:
                p = Placement(2, 8)
                d = Dispatcher(client, {"max_new_tokens": 2}, capacity=1, placement=p)
                await d.admit(_Eng("e0", server.port), dp_ranks=2)
                await asyncio.gather(*(d.run(s) for g in ("g", "h") for s in _group(g, 2)))
                return most[0], p.primed
        finally:
            await server.cleanup()
    most, primed = asyncio.run(go())
    assert primed == 2 and most <= 1 + primed, f"{most} requests at once at an engine of 1 slot ({primed} primers)"
