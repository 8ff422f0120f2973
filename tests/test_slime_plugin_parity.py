"""Plugin mode behaves as slime's own `generate_rollout` (624b824) where the two could differ: the exact batch
size with awaiting rewards, rewards run concurrently on slime's own loop, off-policy masking of continued
stragglers, FAILED samples raised (or dropped and counted). Same stand-in router and worker as
tests/test_slime_adapter.py; slime's `async_utils` is slime's own file (SLIME_SRC or the mirror) where found.
"""
import asyncio
import importlib
import os
import subprocess
import sys
import types

import pytest
from support import slime_standin

from rollout.slime import adapter as slime_adapter
from rollout.slime import state as slime_state
from rollout.slime import Sample
from test_slime_adapter import (HANG, StandInDataSource, StandInRouter, _args, _check_sample, _worker_rollout,
                                router)  # noqa: F401  (router: the fixture)

pytestmark = pytest.mark.timeout(120)
GATE_S = 3.0   # how long a gated reward waits for its peers before giving up (the check is the count, not time)


class Gate:
    """A reward that records who is inside it and waits until `want` calls are inside (or GATE_S passed)."""

    def __init__(self, want):
        self.want, self.inside, self.max_groups, self.calls, self.released = want, [], 0, 0, []
        self.event = None

    async def __call__(self, args, sample):
        self.event = self.event or asyncio.Event()
        self.calls += 1
        self.inside.append(sample.group_index)
        self.max_groups = max(self.max_groups, len(set(self.inside)))
        if self.calls >= self.want:
            self.event.set()
        try:
            await asyncio.wait_for(self.event.wait(), GATE_S)
            self.released.append(True)
        except asyncio.TimeoutError:
            self.released.append(False)
        self.inside.remove(sample.group_index)
        return float(sample.response_length)


GATE = None


async def gated_reward(args, sample):
    return await GATE(args, sample)


@pytest.fixture
def gate():
    def make(want):
        global GATE
        GATE = Gate(want)
        return GATE
    yield make
    globals()["GATE"] = None


def test_batch_is_exact_when_the_reward_awaits(router, gate):
    """rollout_batch_size 2, over-sampling 6, a reward that awaits: slime returns exactly 2 groups (it asserts
    it). Before the fix every group that finished while another awaited its reward was kept: 6 groups."""
    g = gate(12)   # waits until all 6 groups' samples are inside: reached only if seats are not taken first
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=6,
                 custom_rm_path=f"{__name__}.gated_reward")
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[i, i + 1] for i in range(1, 13, 2)], 2))
    assert len(out.samples) == 2 and out.metrics["rollout/groups"] == 2
    assert g.max_groups <= 2          # never more groups in their reward than seats left in the batch
    assert g.calls == 4


def test_rewards_run_concurrently_within_and_across_groups(router, gate):
    """slime runs one task per sample: both samples of both groups are in their reward at once. Before the fix
    the adapter awaited them one sample at a time (the first call waited alone)."""
    g = gate(4)
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, custom_rm_path=f"{__name__}.gated_reward")
    out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2], [3, 4]], 2))
    assert len(out.samples) == 2
    assert g.released == [True] * 4, "a reward waited alone: rewards ran one after another"
    assert g.max_groups == 2


def _slime_async_utils(path="slime/utils/async_utils.py"):
    """slime's own file `path` (SLIME_SRC, else the mirror's HEAD), or None."""
    src = os.environ.get("SLIME_SRC")
    if src and os.path.exists(os.path.join(src, path)):
        with open(os.path.join(src, path)) as fh:
            return fh.read()
    git = "/work/.mirror/THUDM+slime/repo"
    if os.path.isdir(git):
        r = subprocess.run(["git", "-C", git, "show", f"HEAD:{path}"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode == 0:
            return r.stdout
    return None


LOOPS = []


async def loop_reward(args, sample):
    LOOPS.append(asyncio.get_running_loop())
    return 1.0


@pytest.fixture
def slime_loop():
    """slime's `slime.utils.async_utils` importable (slime's own code), the adapter's loop forgotten around it."""
    name = "slime.utils.async_utils"
    saved = sys.modules.get(name)
    if saved is None and slime_standin.REAL:
        saved = importlib.import_module(name)   # the real slime: its own module
    if saved is None:
        code = _slime_async_utils()
        if code is None:
            pytest.skip("slime's async_utils not found (set SLIME_SRC)")
        module = types.ModuleType(name)
        exec(compile(code, "slime/utils/async_utils.py", "exec"), module.__dict__)
        sys.modules[name] = module
    slime_adapter.reset()
    slime_state.STATE.loop = None
    yield sys.modules[name]
    slime_adapter.reset()
    slime_state.STATE.loop = None
    if saved is None:
        sys.modules.pop(name, None)


def test_rewards_run_on_slimes_own_loop(router, slime_loop):
    """remote_rm's aiohttp session is bound to slime's loop (eval runs there): training rewards must run on
    that same loop. Before the fix they ran on a second loop of the adapter's."""
    LOOPS.clear()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=1, custom_rm_path=f"{__name__}.loop_reward")
    slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2]], 2))
    assert LOOPS and all(lp is slime_loop.get_async_loop().loop for lp in LOOPS)


def test_continued_straggler_masks_its_off_policy_tokens(router):
    """--partial-rollout --mask-offpolicy-in-partial-rollout: slime sets loss_mask 0 on the tokens generated
    before the step ended. Before the fix the continued straggler kept loss_mask [1, 1, 1, 1]."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=3,
                 mask_offpolicy_in_partial_rollout=True)
    src = StandInDataSource([[1, 2], [HANG, 3], [4, 5], [6, 7], [8, 9]], 2)
    first = slime_adapter.generate_rollout(args, 0, src)
    assert first.metrics["rollout/carried"] == 1
    args.over_sampling_batch_size = 2
    second = slime_adapter.generate_rollout(args, 1, src)
    hang = [g for g in second.samples if g[0].tokens[0] == HANG][0]
    for s in hang:
        _check_sample(s, [HANG, 3])
        assert s.loss_mask == [0, 1, 1, 1]   # 1 token before the abort (the stand-in's straggler), 3 after
    fresh = [g for g in second.samples if g[0].tokens[0] != HANG][0]
    assert all(s.loss_mask == [1, 1, 1, 1] for s in fresh)


def test_failed_groups_are_dropped_and_counted_when_asked(monkeypatch):
    """With SLIME_MOE_ROLLOUT_DROP_FAILED=1 a group with a FAILED sample is left out and counted; before the
    fix it was delivered, rewarded and counted nowhere."""
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_DROP_FAILED", "1")
    router = StandInRouter([("http://127.0.0.1:1", "prefill"), ("http://127.0.0.1:2", "decode")]).start()
    try:
        slime_adapter.reset()
        out = _worker_rollout(router, 0, [[1, 2]])
        assert out.samples == [] and out.metrics["rollout/failed_groups"] == 1
    finally:
        slime_adapter.reset()
        router.stop()


def test_disable_rollout_global_dataset_with_the_default_source_is_refused(router):
    """slime's generate_rollout asserts rollout_global_dataset; before, plugin mode sent empty prompts."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_global_dataset=False,
                 data_source_path="slime.rollout.data_source.RolloutDataSourceWithBuffer")
    with pytest.raises(ValueError, match="--disable-rollout-global-dataset with slime's default data source"):
        slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2]], 2))
    assert router.worker.requests == []


def test_multimodal_prompts_are_refused_in_one_line(router):
    """slime sends a sample's images as image_data; plugin mode sends tokens only, so it refuses (before, the
    images were dropped without a word)."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    src = StandInDataSource([[1, 2]], 2)
    got = src.get_samples

    def with_images(k):
        out = got(k)
        for g in out:
            for s in g:
                s.multimodal_inputs = {"images": ["img"]}
        return out
    src.get_samples = with_images
    with pytest.raises(ValueError, match="sample index 0 has multimodal inputs \\(images\\)"):
        slime_adapter.generate_rollout(_args(router.port, rollout_batch_size=1), 0, src)
    assert router.worker.requests == []


def test_router_flags_that_cannot_apply_print_one_warning_at_attach(router, capsys):
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=1, router_policy="round_robin",
                 sglang_router_request_timeout_secs=60)
    slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2]], 2))
    lines = [x for x in capsys.readouterr().err.splitlines() if "do(es) not apply in plugin mode" in x]
    assert len(lines) == 1
    assert "--router-policy round_robin" in lines[0] and "--sglang-router-request-timeout-secs 60" in lines[0]
    slime_adapter.generate_rollout(args, 1, StandInDataSource([[3, 4]], 2))   # attached once: no second line
    assert "do(es) not apply" not in capsys.readouterr().err


def pick_last(args, rollout_id, buffer, num_samples):
    """A --buffer-filter-path function (slime's signature): the newest groups first."""
    PICKED.append(len(buffer))
    out = buffer[-num_samples:]
    del buffer[-num_samples:]
    return out


PICKED = []


def test_recycled_groups_go_through_slimes_buffer_and_its_filter(router):
    """Unfinished groups go back through data_source.add_samples, so slime's buffer filter picks them.
    Before the fix they stayed inside the manager: add_samples was never called, the filter never ran."""
    PICKED.clear()
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=3,
                 buffer_filter_path=f"{__name__}.pick_last")

    class Buffered(StandInDataSource):   # slime's RolloutDataSourceWithBuffer, with --buffer-filter-path
        def get_samples(self, k):
            out = pick_last(args, None, self.buffer, k) if self.buffer else []
            rest, self.buffer, saved = k - len(out), [], self.buffer
            out += StandInDataSource.get_samples(self, rest) if rest else []
            self.buffer = saved
            return out

    src = Buffered([[1, 2], [HANG, 3], [4, 5], [6, 7], [8, 9]], 2)
    slime_adapter.generate_rollout(args, 0, src)
    assert len(src.buffer) == 1 and src.buffer[0][0].metadata["start_rollout_id"] == 0
    args.over_sampling_batch_size = 2
    second = slime_adapter.generate_rollout(args, 1, src)
    assert PICKED == [1] and HANG in {g[0].tokens[0] for g in second.samples}


@pytest.fixture
def slime_filter_hub():
    """slime's own slime/rollout/filter_hub/base_types.py importable (SLIME_SRC or the mirror)."""
    name = "slime.rollout.filter_hub.base_types"
    if name in sys.modules or slime_standin.REAL:
        yield importlib.import_module(name)
        return
    code = _slime_async_utils("slime/rollout/filter_hub/base_types.py")
    if code is None:
        pytest.skip("slime's filter_hub not found (set SLIME_SRC)")
    hub, module = types.ModuleType("slime.rollout.filter_hub"), types.ModuleType(name)
    exec(compile(code, "slime/rollout/filter_hub/base_types.py", "exec"), module.__dict__)
    sys.modules["slime.rollout.filter_hub"], sys.modules[name] = hub, module
    yield module
    sys.modules.pop(name, None)
    sys.modules.pop("slime.rollout.filter_hub", None)


OPEN_AT_REFILL = []


def drop_one_two(args, samples):
    return samples[0].tokens[0] != 1   # slime's legacy bool form: the group of prompt [1, 2] is dropped


def test_refill_starts_while_the_straggler_runs(router, slime_filter_hub):
    """slime submits the next over-sampling chunk as soon as a dropped group leaves remaining < target, while
    the others still run. Before the fix the round ran to its end first: the refill waited for the straggler
    (here it would wait until the straggler's request gave up: the stand-in aborts it only when the batch is full)."""
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=2, over_sampling_batch_size=2,
                 dynamic_sampling_filter_path=f"{__name__}.drop_one_two")
    src = StandInDataSource([[HANG, 3], [1, 2], [4, 5], [6, 7]], 2)
    got = src.get_samples

    def fetch(k):
        OPEN_AT_REFILL.append(not router.worker.aborted.is_set())
        return got(k)
    src.get_samples = fetch
    OPEN_AT_REFILL.clear()
    out = slime_adapter.generate_rollout(args, 0, src)
    assert OPEN_AT_REFILL == [True, True]   # the second fetch came while the straggler's request was open
    assert sorted(g[0].tokens[0] for g in out.samples) == [4, 6]
    assert out.metrics["rollout/recycled_groups"] == 1   # the straggler, aborted when the batch was full


def test_finished_groups_that_find_the_batch_full_go_back_to_slimes_buffer(router, gate):
    """slime's abort collects every pending group when the batch is full, finished ones included, and with
    --partial-rollout puts them in its buffer. Before, plugin mode dropped a group that finished while the last
    seat was taken (its prompt lost): here 2 of 3 groups, while the kept one awaited its reward."""
    gate(3)   # the kept group's 2 samples wait in their reward (for a third that never comes) while the rest finish
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    args = _args(router.port, rollout_batch_size=1, over_sampling_batch_size=3,
                 custom_rm_path=f"{__name__}.gated_reward")
    src = StandInDataSource([[1, 2], [3, 4], [5, 6]], 2)
    out = slime_adapter.generate_rollout(args, 0, src)
    assert len(out.samples) == 1 and out.metrics["rollout/recycled_groups"] == 2
    kept = out.samples[0][0].tokens[0]
    assert sorted(g[0].tokens[0] for g in src.buffer) == sorted({1, 3, 5} - {kept})
    for g in src.buffer:
        for s in g:
            assert s.status == Sample.Status.TRUNCATED and s.response_length == 4 and s.metadata["start_rollout_id"] == 0
    sent = len(router.worker.requests)
    second = slime_adapter.generate_rollout(args, 1, src)   # from the buffer: rewarded now, no new request
    assert second.samples[0][0].reward == 4.0 and len(router.worker.requests) == sent
