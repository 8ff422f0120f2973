"""The version matrix: on every reviewed SGLang variant besides the main environment's 0.5.23, in its own
environment (`.venvs/sglang-<variant>`, built by `scripts/setup_sglang_env.sh`), `patches status` names the
variant and is all good, and the scenario list (sglang_patches/scenarios/dp.py, one process per state) does what
the variant's port table says: a hooked fix's scenarios fail on the stock tree with the specific defect
(the needle in the scenario's detail) and pass with the plugin loaded by SGLang's `load_plugins()`; guards
pass both; a not-needed fix's defect shows in both and its reach scenarios pass.

`make test` builds the environments first and lists them in SLIME_MOE_ROLLOUT_MATRIX: a listed
environment that is missing fails; an unlisted one is skipped (e.g. the slime variant without
SLIME_SRC). 0.5.23 is covered by test_dp_fixes.py. One interpreter per release runs every scenario list
(sglang_patches/scenarios/every.py), shared with test_retraction_rows.py and test_next_defects_sglang.py;
tests/support/variant_runs.py runs the next release's work while this one's tests run.
"""
import os
import subprocess
import sys

import pytest

from sglang_patches.scenarios import dp as dp_scenarios
from sglang_patches.scenarios.runner import ROOT
from sglang_patches.registry import VARIANTS, all_fixes, table
from sglang_patches.states import FixState
from support.variant_runs import scenarios, status

MATRIX = [v.name for v in VARIANTS if v.name != "0.5.23"]


def ports(variant):
    return table(next(v for v in VARIANTS if v.name == variant).table)


def cases(pred):
    return [(v, name) for v in MATRIX for name, want in dp_scenarios.expected(v).items() if pred(want)]


def results(variant):
    return scenarios(variant)


def patches_status(variant, family, kind="plain"):
    """(answer, report, {fix: state} of `family`) of `patches status --json` on the variant, with
    support.variant_runs.STATUS_ENV[kind] set (the three settings in one interpreter per release)."""
    r, report = status(variant, kind)
    return r, report, {f["name"]: f["state"] for f in report["fixes"] if f["family"] == family}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", MATRIX)
def test_status_names_variant_and_is_all_good(variant):
    r, report, states = patches_status(variant, "dp-attention")
    assert report["variant"] == variant, report["variant_problem"]
    want = {f.name: ports(variant)[f.name].state.value for f in all_fixes() if f.family == "dp-attention"}
    assert states == want
    assert r.returncode == 0 and report["ok"], r.stderr
    r3 = {f["name"]: (f["state"], f["reason"]) for f in report["fixes"] if f["family"] == "r3"}
    assert r3 == {"retraction-rows": ("active", "3 hook(s)"),    # hooked on every reviewed release
                  "retraction-routes": ("active", "3 hook(s)"),
                  "tokenizer-workers": ("active", "1 hook(s)")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", MATRIX)
def test_status_with_cpu_engine_matches_the_table(variant):
    """In a CPU engine's process (SGLANG_USE_CPU_ENGINE=1) the CPU family is judged for real: each ported
    fix is active (its pins are this tree's source) or hook-less as its table says, an unported one is
    refused (status exits 1 there only), and the graph-replay fixes stay idle unless asked for."""
    r, report, states = patches_status(variant, "cpu", "cpu")
    cpu = [f for f in all_fixes() if f.family == "cpu" and not f.name.startswith("cpu-graphs-")]
    want = {f.name: ports(variant)[f.name].state.value if f.name in ports(variant) else "refused" for f in cpu}
    assert {n: states[n] for n in want} == want
    assert (r.returncode == 0) == ("refused" not in want.values()), r.stderr[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", MATRIX)
def test_status_with_cpu_graphs_matches_the_table(variant):
    """With CPU graph replay asked for (SLIME_MOE_ROLLOUT_CPU_GRAPHS=1) in a CPU engine's process, each graph
    fix the variant's table lists is active (its pins are this tree's source); an unlisted one is refused."""
    r, report, states = patches_status(variant, "cpu", "graphs")
    graphs = [f.name for f in all_fixes() if f.name.startswith("cpu-graphs-")]
    want = {n: ports(variant)[n].state.value if n in ports(variant) else "refused" for n in graphs}
    assert {n: states[n] for n in graphs} == want, report


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", MATRIX)
def test_plugin_registers_the_variant_fixes(variant):
    res = results(variant)
    hooked = [f.name for f in all_fixes() if f.name in ports(variant) and ports(variant)[f.name].state is FixState.ACTIVE
              and f.when is None]
    assert res["plugin"]["_meta"]["registered"] == hooked
    assert res["none"]["_meta"]["registered"] == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant,scenario", cases(lambda want: want[0] is not None and want[1]))
def test_fix_on_variant(variant, scenario):
    res = results(variant)
    needle = dp_scenarios.expected(variant)[scenario][0]
    stock, fixed = res["none"][scenario], res["plugin"][scenario]
    assert not stock["ok"] and needle in stock["detail"], f"stock SGLang {variant}: {stock}"
    assert fixed["ok"], f"still wrong with the plugin: {fixed}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant,scenario", cases(lambda want: want[0] is None))
def test_guard_on_variant(variant, scenario):
    res = results(variant)
    for state in ("none", "plugin"):
        assert res[state][scenario]["ok"], f"{state}: {res[state][scenario]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant,scenario", cases(lambda want: want[0] is not None and not want[1]))
def test_latent_defect_on_variant(variant, scenario):
    """A defect that no supported configuration reaches (a `not-needed` fix; its reach scenarios say why):
    it shows with and without the plugin, with the specific error."""
    res = results(variant)
    needle = dp_scenarios.expected(variant)[scenario][0]
    for state in ("none", "plugin"):
        got = res[state][scenario]
        assert not got["ok"] and needle in got["detail"], f"{state}: {got}"


def test_unreviewed_version_gets_one_line_and_no_hook():
    """0.5.14 (never reviewed): the plugin logs one line and hooks no fix (only the read-only fix report,
    which tells admission why)."""
    code = ("import logging, sys; from unittest import mock; from sglang_patches import plugin, registry, report\n"
            "logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format='%(message)s')\n"
            "from sglang.srt.plugins.hook_registry import HookRegistry\n"
            "def reg(target, *a, **kw):\n"
            "    if target != report.STATE: raise AssertionError('hooked ' + target)\n"
            "mock.patch.object(HookRegistry, 'register', side_effect=reg).start()\n"
            "mock.patch.object(registry, 'sglang_version', lambda: '0.5.14').start(); print(plugin.register())")
    r = subprocess.run([sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert r.returncode == 0, r.stderr[-2000:]
    assert lines[-1] == "[]" and len(lines) == 2, lines
    assert lines[0].startswith("slime-moe-rollout: no fixes applied: SGLang 0.5.14 is not a reviewed version")


@pytest.mark.parametrize("args,env,needle", [
    (["0.5.99"], {}, "no requirements/sglang-0.5.99.txt (SGLang 0.5.99 has no environment)"),
    (["0.5.15.post1+slime"], {"SLIME_SRC": ""}, "0.5.15.post1+slime needs SLIME_SRC=<slime checkout>"),
    (["0.5.15.post1+slime"], {"SLIME_SRC": "/nonexistent"}, "/nonexistent/docker/patch/latest/sglang.patch not found"),
    (["0.5.15.post1+other"], {}, "unknown variant suffix '+other' (known: +slime)"),
])
def test_env_script_bad_input_one_line(args, env, needle):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_sglang_env.sh"), *args], capture_output=True,
                       text=True, timeout=60, env={**os.environ, **env})
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and needle in r.stderr, r.stderr
