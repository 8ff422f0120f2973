"""The plugin's fix report in `/server_info` (sglang_patches.report) on every reviewed release, and the
admission check that reads it (rollout.engines.readiness). Per release: one interpreter runs SGLang's own
`load_plugins()` and calls the wrapped `get_internal_state` on a real TokenizerManager object
(tests/support/fix_report_probe.py): every DP rank's state carries the report, a configuration needing
routed-experts-rows is good as loaded, and refused when that fix is disabled or the release unreviewed."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang_patches.registry import VARIANTS
from sglang_patches.report import REPORT_KEY, problem
from support.variant_runs import ahead, python_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "support", "fix_report_probe.py")


def _probe(variant):
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE",
                                                             "SLIME_MOE_ROLLOUT_REVIEW_AS")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([str(python_of(variant)), PROBE], capture_output=True, text=True, timeout=240, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, f"rc {r.returncode}: {r.stderr[-2000:]}"
    return json.loads(line[len("REPORT "):])


CHEAP = {"0.5.23", "0.5.15.post1"}   # make test: the main environment and slime's pin; the rest in test-e2e
                                     # (one SGLang import each, ~40 s on a loaded 2-core machine)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", [v.name if v.name in CHEAP else pytest.param(v.name, marks=pytest.mark.e2e)
                                     for v in VARIANTS])
def test_report_on_every_reviewed_release(variant):
    out = ahead("fix-report", _probe, variant)
    states = out["loaded"]["states"]
    assert [s["rank"] for s in states] == [0, 1]                         # SGLang's own answer is kept
    reports = [s[REPORT_KEY] for s in states]
    version = next(v.version for v in VARIANTS if v.name == variant)
    assert all(r["sglang_version"] == version and r["refusal"] is None for r in reports)
    rows = {f["name"]: f for f in reports[0]["fixes"]}
    assert rows["routed-experts-rows"]["needed"] and rows["routed-experts-rows"]["good"]
    assert out["loaded"]["problem"] is None
    assert out["disabled"]["problem"] == ("needed fixes not active: routed-experts-rows disabled "
                                          "(disabled by SLIME_MOE_ROLLOUT_DISABLE)")
    assert out["unreviewed"]["problem"] == (f"SGLang {version}: no fixes applied: SLIME_MOE_ROLLOUT_REVIEW_AS=0.0.0 "
                                            "is not a reviewed variant")


def test_no_report_means_no_plugin():
    assert problem({"internal_states": [{"rank": 0}]}).startswith("no slime-moe-rollout fix report in /server_info")
    assert problem({"dp_size": 1}).startswith("no slime-moe-rollout fix report")   # 0.5.15-style answer, no plugin


def _engine():
    return SimpleNamespace(name="e-0", alive=lambda: True, log_tail=lambda: [], exit_reason=lambda: "")


def _admit(info, allow):
    from rollout.engines.readiness import NullView, ReadyInfo, _admit_fixes
    from training_configs.schema import RolloutConfig

    r = RolloutConfig(batch_size=1, n_samples_per_prompt=1, allow_unfixed=allow)
    _admit_fixes(_engine(), r.allow_unfixed, ReadyInfo(1, None, server_info=info), NullView())


BAD = {"internal_states": [{REPORT_KEY: {"sglang_version": "0.5.23", "refusal": None, "fixes": [
    {"name": "routed-experts-rows", "state": "disabled", "needed": True, "good": False,
     "reason": "disabled by SLIME_MOE_ROLLOUT_DISABLE"}]}}]}


def test_admission_refuses_in_one_line_and_the_switch_says_so(capsys):
    from rollout.engines.readiness import ReadinessError

    with pytest.raises(ReadinessError) as e:
        _admit(BAD, allow=False)
    msg = str(e.value).splitlines()[0]
    assert "e-0" in msg and "refused: needed fixes not active: routed-experts-rows disabled" in msg
    assert "rollout.allow_unfixed: true" in msg
    _admit(BAD, allow=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["e-0: admitted WITHOUT its fixes (rollout.allow_unfixed: true): needed fixes not active: "
                   "routed-experts-rows disabled (disabled by SLIME_MOE_ROLLOUT_DISABLE)"]


def test_the_config_switch_reaches_the_fleets_admission():
    from rollout import config as rconfig
    from rollout.manager import engine_source

    cfg = rconfig.load("a")
    for allow in (False, True):
        cfg.rollout.allow_unfixed = allow
        assert engine_source(cfg, backend=object(), model_path="/m", ports=[31234]).allow_unfixed is allow
