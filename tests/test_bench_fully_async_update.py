"""benchmarks/fully_async_update.py without engines: its figures come from the loop worker's answers (trainer wait
outside training and updates, tokens per loop update, groups delivered once), a worse arm prints MISS, thrown
tokens are not judged where slime's arm threw none, and `--dry` judges every target of its table."""
import copy
import importlib
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    targets = importlib.import_module("_targets")
    monkeypatch.setattr(targets, "_judged", [])
    return importlib.import_module("fully_async_update")


def _judged(out: str) -> dict:
    return {ln.split(":")[0].split(".", 1)[1]: ln.rsplit(" ", 1)[1] for ln in out.splitlines() if ": ratio " in ln}


def test_trainer_wait_is_the_loop_time_outside_training_and_updates(bench):
    arm = bench._dry_arm([3.0, 0.5, 0.25, 0.75], 0)
    wait, first = bench.trainer_wait(arm)
    assert first == pytest.approx(3.0) and wait == pytest.approx((0.5 + 0.25 + 0.75) / 3)
    assert bench.trainer_wait(arm, updates=True)[0] == pytest.approx((0.5 + 0.25 + 0.75) / 3 + 0.5)   # + the update
    t = bench.per_update(bench._dry_arm([0, 0, 0, 0], 100, thrown=30))
    assert (t["updates"], t["aborted"], t["thrown"], t["undelivered"]) == (4, 100, 30, 0)


def test_groups_twice_or_never_are_counted(bench):
    arm = bench._dry_arm([0, 0, 0, 0], 0, kill=True)
    assert bench.once(arm) == 0
    arm["delivered"] = [0, 1, 1, 2, 3, 4, 5, 6]   # group 1 twice, group 7 never
    assert bench.once(arm) == 2


def test_a_worse_arm_misses_and_thrown_tokens_need_slimes(bench, capsys):
    res, k3 = copy.deepcopy(bench.DRY), copy.deepcopy(bench.DRY_K3)
    res["ours"] = bench._dry_arm([0.5, 2.0, 2.5, 2.0], 40, thrown=5)     # waits like slime's, aborts a third
    res["slime-async"] = bench._dry_arm([1.2, 0.9, 1.1, 1.0], 120)       # slime threw nothing away
    res["kill"]["delivered"] = res["kill"]["delivered"][:-1] * 1          # a group never delivered
    k3["off"]["span"] = k3["off"]["rest"] * 1.2                          # the control does not separate
    bench.report(res, k3)
    out = capsys.readouterr().out
    assert _judged(out) == {"aborted_tokens": "MISS", "trainer_wait_vs_sync": "MISS",
                            "trainer_wait_vs_slime_async": "MISS", "k3_kl_spanning": "PASS",
                            "k3_kl_spanning_disabled": "MISS", "groups_not_once": "MISS"}
    assert "thrown_tokens not judged: slime's fully-async threw away 0.0 tokens per update" in out
    assert sys.modules["_targets"].finish() == 3


def test_dry_run_judges_every_target_and_without_slime_says_why(bench):
    env = dict(os.environ, SLIME_SRC="")
    dry = subprocess.run([sys.executable, os.path.join(BENCH, "fully_async_update.py"), "--dry"],
                         capture_output=True, text=True, timeout=60, env=env)
    spec = sys.modules["_targets"].table()["fully_async_update"]
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert set(_judged(dry.stdout)) == set(spec["targets"]) and set(_judged(dry.stdout).values()) == {"PASS"}
    off = subprocess.run([sys.executable, os.path.join(BENCH, "fully_async_update.py")], capture_output=True,
                         text=True, timeout=60, env=env)
    assert off.returncode == 0 and "not run: no slime checkout given" in off.stdout, off.stdout + off.stderr
    assert spec["engine"] is True and spec["slime_src"] is True
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "fully_async_update.py"), "--steps", "1"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--steps" in bad.stderr.splitlines()[-1]


def test_no_pool_runs_out_of_prompts_before_the_last_update(bench, capsys):
    """slime's fully-async worker takes up to concurrency x engines groups in flight and as many finished ones
    ahead of the trainer: with only the steps' groups (and one more batch) every pool ran dry by the third call of
    a real run, and the later updates had nothing in flight (an arm with no sample spanning an update)."""
    for steps, groups, concurrency in ((5, 4, 8), (2, 2, 2), (8, 16, 4)):
        slime_ahead = 2 * concurrency * 2   # two engines (the kill arm)
        assert bench.prompt_count(steps, groups, concurrency) >= steps * groups + slime_ahead
    res, k3 = copy.deepcopy(bench.DRY), copy.deepcopy(bench.DRY_K3)
    res["slime-async"]["dry"] = 3
    bench.report(res, k3)
    assert "slime-async: the data source ran out of prompts 3 times before the loop ended" in capsys.readouterr().out
