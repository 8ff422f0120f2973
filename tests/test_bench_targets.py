"""The benchmarks' targets table: every benchmark has targets, judged lines have one format, a MISS exits 3."""
import importlib
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def targets(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    mod = importlib.import_module("_targets")
    monkeypatch.setattr(mod, "_judged", [])
    return mod


def test_every_benchmark_has_targets_and_every_entry_a_script(targets):
    sys.path.insert(0, BENCH)
    import run_all

    tab = targets.table()
    assert sorted(run_all.scripts()) == sorted(tab)
    for name, spec in tab.items():
        assert spec["targets"], name
        for t in spec["targets"].values():
            assert ("min" in t) != ("max" in t), (name, t)


def test_judged_line_format_and_miss_exit(targets, capsys):
    assert targets.judge("dispatcher_scale", "seed_req_per_cpu_s", 0.97) is True
    assert targets.finish() == 0
    assert targets.judge("routed_experts", "decode_time", 1.25) is False
    out = capsys.readouterr().out.splitlines()
    assert out == ["dispatcher_scale.seed_req_per_cpu_s: ratio 0.970 (target >= 0.95) PASS",
                   "routed_experts.decode_time: ratio 1.250 (target <= 1.0) MISS"]
    assert targets.finish() == targets.MISS_EXIT == 3


def test_run_all_fails_a_miss_in_full_mode_and_reports_it_in_quick(targets, monkeypatch, tmp_path, capsys):
    import run_all

    script = tmp_path / "fake_bench.py"
    script.write_text("import sys\nprint('fake_bench.t: ratio 2.000 (target <= 1.0) MISS')\nsys.exit(3)\n")
    monkeypatch.setattr(run_all, "HERE", str(tmp_path))
    monkeypatch.setattr(run_all, "table", lambda: {"fake_bench": {"quick_args": [], "targets": {"t": {"max": 1.0}}}})
    assert run_all.main(["--quick"]) == 0
    assert run_all.main([]) == 1
    assert "MISS: fake_bench.t" in capsys.readouterr().out
    script.write_text("raise SystemExit(1)\n")  # a crash fails both
    assert run_all.main(["--quick"]) == 1


def test_slime_arm_answer_parsing_and_why_it_is_skipped(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(BENCH)
    arm = importlib.import_module("_slime_arm")
    line = 'SLIME-ARM {"seconds": 2.0, "groups": 4, "tokens": 256, "prompt_tokens": 8192, "cached_tokens": 6144}\n'
    assert arm.parse_reply(line) == {"seconds": 2.0, "groups": 4, "tokens": 256, "prompt_tokens": 8192,
                                     "cached_tokens": 6144}
    assert arm.parse_reply("[2026] INFO router started\n") is None   # slime's own log lines pass by
    with pytest.raises(RuntimeError, match="slime arm: AssertionError: name='dp_size'"):
        arm.parse_reply('SLIME-ARM {"error": "AssertionError: name=\'dp_size\'"}')
    assert arm.unavailable(None) == "no slime checkout given (SLIME_SRC or --slime-src)"
    assert arm.unavailable(str(tmp_path)) == f"--slime-src {tmp_path} has no slime/ package"
    (tmp_path / "slime").mkdir()
    monkeypatch.setattr(arm, "SLIME_PYTHON", str(tmp_path / "no-python"))
    assert arm.unavailable(str(tmp_path)).startswith(f"SLIME_PYTHON {tmp_path / 'no-python'} missing")


def test_slime_targets_are_judged_only_with_a_slime_checkout(targets):
    spec = targets.table()["group_placement_engines"]
    assert spec["slime_src"] is True
    assert {t for t, v in spec["targets"].items() if v.get("slime")} == {"engine_prefill_vs_slime",
                                                                         "engine_tokens_per_s_vs_slime"}
