"""benchmarks/slime_multiturn.py without engines: its generate function builds slime's 3-turn sample (tool
observations with loss mask 0, each turn's meta_info counts kept), its figures and judged lines come from the
worker's answers (primers counted for ours), a worse arm prints MISS, and `--dry` judges recorded figures."""
import asyncio
import importlib
import os
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
from support.fake_sglang import FakeSGLang, answer
from support.slime_standin import REAL as SLIME_AVAILABLE

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    targets = importlib.import_module("_targets")
    monkeypatch.setattr(targets, "_judged", [])
    return importlib.import_module("slime_multiturn")


@pytest.fixture
def slime_post(monkeypatch):
    """slime's `post` where slime is importable, else a STAND-IN module of that name (one aiohttp POST)."""
    if SLIME_AVAILABLE:
        from slime.utils import http_utils
        http_utils.init_http_client(SimpleNamespace(sglang_server_concurrency=4, rollout_num_gpus=1,
                                                    rollout_num_gpus_per_engine=1, use_distributed_post=False))
        return
    import aiohttp

    async def post(url, payload, max_retries=60, headers=None):
        async with aiohttp.ClientSession() as s, s.post(url, json=payload, headers=headers) as r:
            r.raise_for_status()
            return await r.json(content_type=None)
    mod = types.ModuleType("slime.utils.http_utils")
    mod.post = post
    for name in ("slime", "slime.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "slime.utils.http_utils", mod)


class _Sample(SimpleNamespace):
    Status = SimpleNamespace(COMPLETED="completed")


def test_three_turns_builds_slimes_sample_with_observations_masked(bench, slime_post, monkeypatch):
    bodies = []

    async def generate(request):
        body = await request.json()
        bodies.append(body)
        n = len(body["input_ids"])
        return __import__("aiohttp").web.json_response(answer([9] * 4, {"type": "length"}, prompt_tokens=n,
                                                              cached_tokens=n - 64))
    srv = FakeSGLang({"/generate": generate}).start()
    monkeypatch.setenv(bench.OBS_ENV, "64")
    try:
        args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=srv.port)
        s = asyncio.run(bench.three_turns(args, _Sample(index=3, tokens=list(range(300)), metadata={}),
                                          {"max_new_tokens": 4, "temperature": 1.0}))
    finally:
        srv.stop()
    assert [len(b["input_ids"]) for b in bodies] == [300, 368, 436]   # + 4 generated + 64 observed per turn
    budgets = [bench.turn_budget(3, turn, 4) for turn in range(3)]   # each turn's length, 2..6 around 4
    assert [b["sampling_params"] for b in bodies] == [{"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}
                                                      for n in budgets]
    assert all(2 <= n <= 6 for n in budgets) and budgets == [bench.turn_budget(3, turn, 4) for turn in range(3)]
    assert bodies[2]["input_ids"][:368] == bodies[1]["input_ids"]   # each turn continues the whole sequence
    assert s.loss_mask == [1] * 4 + [0] * 64 + [1] * 4 + [0] * 64 + [1] * 4
    assert s.response_length == len(s.tokens) - 300 == len(s.rollout_log_probs) == 140
    assert [t[:4] for t in s.metadata["turns"]] == [[0, 300, 236, 4], [1, 368, 304, 4], [2, 436, 372, 4]]
    assert s.status == "completed"


def test_figures_count_primers_and_a_worse_arm_misses(bench, capsys):
    turns = lambda cached: [[k, 300, cached, 16, 2.0] for k in range(3) for _ in range(16)]  # noqa: E731
    ours = bench.summarise({"seconds": 3.0, "primer_prefilled": 480, "turns": turns(290)})
    assert ours["prefill_per_turn"] == (48 * 10 + 480) / 48 == 20.0
    assert ours["tokens_per_s"] == 48 * 16 / 2.0 and ours["by_turn"] == [10.0, 10.0, 10.0]
    assert ours["per_verify"] is None   # an answer without NEXTN's spec_verify_ct
    spec = bench.summarise({"seconds": 3.0, "turns": [t + [8] for t in turns(290)]})
    assert spec["per_verify"] == 2.0 and spec["tokens_per_s"] == ours["tokens_per_s"]
    slime = bench.summarise({"seconds": 2.0, "turns": turns(250)})
    bench.report({"ours": [ours], "slime": [slime]})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ": ratio " in ln]
    assert lines == ["slime_multiturn.prefill_per_turn: ratio 0.400 (target <= 0.5) PASS",
                     "slime_multiturn.tokens_per_s: ratio 1.000 (target >= 1.0) PASS",
                     "slime_multiturn.step_time: ratio 1.500 (target <= 1.05) MISS"]
    assert sys.modules["_targets"].finish() == 3


def test_dry_run_judges_every_target_and_without_slime_says_why(bench):
    env = dict(os.environ, SLIME_SRC="")
    dry = subprocess.run([sys.executable, os.path.join(BENCH, "slime_multiturn.py"), "--dry"], capture_output=True,
                         text=True, timeout=60, env=env)
    spec = sys.modules["_targets"].table()["slime_multiturn"]
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert sorted(ln.split(":")[0] for ln in dry.stdout.splitlines() if ": ratio " in ln) == \
        sorted(f"slime_multiturn.{t}" for t in spec["targets"])
    off = subprocess.run([sys.executable, os.path.join(BENCH, "slime_multiturn.py")], capture_output=True,
                         text=True, timeout=60, env=env)
    assert off.returncode == 0 and "not run: no slime checkout given" in off.stdout, off.stdout + off.stderr
    assert spec["engine"] is True and spec["slime_src"] is True


def test_the_benchmarks_own_manager_does_not_probe_inside_the_timed_steps(bench):
    """The tiny config probes every 2 s: a one-token /generate inside every arm's ~13 s step, unless raised."""
    from rollout import config as rconfig

    cfg = rconfig.load("c")
    assert cfg.rollout.health.interval_s < 13
    bench.quiet_probes(cfg)
    assert cfg.rollout.health.interval_s >= bench.PROBE_S >= 60
