"""The version matrix: on every extra reviewed SGLang variant, in its own environment
(`.venvs/sglang-<variant>`, built by `scripts/setup_sglang_env.sh`), `patches status` names the
variant and is all good, and every fix's scenarios fail on the stock tree with the specific defect
(the needle in the scenario's detail) and pass with the plugin loaded by SGLang's `load_plugins()`.

`make test` builds the environments first and lists them in SLIME_MOE_ROLLOUT_MATRIX: a listed
environment that is missing fails; an unlisted one is skipped (e.g. the slime variant without
SLIME_SRC). 0.5.23, the main environment's version, is covered by test_dp_fixes.py.
"""
import importlib
import json
import os
import subprocess

import pytest

from scenario_runner import ROOT, env_python, run_states

# variant -> scenario script (module in tests/) whose EXPECT[variant] lists fixes and guards
MATRIX = {
    "0.5.15.post1": "dp_scenarios_v0_5_15",
    "0.5.15.post1+slime": "dp_scenarios_v0_5_15",
    "0.5.16": "dp_scenarios_v0_5_16",
}
REQUIRED = set(os.environ.get("SLIME_MOE_ROLLOUT_MATRIX", "").split())


def python_of(variant):
    py = env_python(variant)
    if not py.exists():
        if variant in REQUIRED:
            pytest.fail(f"{py} missing: run scripts/setup_sglang_env.sh {variant}")
        pytest.skip(f"no environment for SGLang {variant} (scripts/setup_sglang_env.sh {variant})")
    return py


def expect(variant):
    return importlib.import_module(MATRIX[variant]).EXPECT[variant]


def cases(kind):
    return [(v, fix) for v in MATRIX for fix in expect(v).get(kind, ())]


_results = {}


def results(variant):
    if variant not in _results:
        _results[variant] = run_states(["none", "plugin"], script=MATRIX[variant] + ".py",
                                       python=python_of(variant), timeout=600)
    return _results[variant]


def patches_status(variant, family, **env):
    """(process, report, {fix: state} of `family`) of `patches status --json` in the variant's environment."""
    clean = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE")}
    r = subprocess.run([str(python_of(variant)), "-m", "rollout.cli", "patches", "status", "--json"],
                       capture_output=True, text=True, timeout=280, cwd=ROOT, env=dict(clean, **env))
    report = json.loads(r.stdout)
    return r, report, {f["name"]: f["state"] for f in report["fixes"] if f["family"] == family}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(MATRIX))
def test_status_names_variant_and_is_all_good(variant):
    r, report, states = patches_status(variant, "dp-attention")
    assert report["variant"] == variant, report["variant_problem"]
    assert states == expect(variant)["states"]
    assert r.returncode == 0 and report["ok"], r.stderr


# variant -> the CPU family's states in a CPU engine's process (SGLANG_USE_CPU_ENGINE=1)
CPU_HOOKED = ("cpu-host-register", "cpu-cuda-synchronize", "cpu-eagle-attn-backend", "cpu-torch-native-fill",
              "cpu-ep-native-moe", "cpu-gloo-scatter-gather", "cpu-gloo-stacked-allgather", "cpu-thread-binding")
CPU_STATES = {"0.5.16": {**dict.fromkeys(CPU_HOOKED, "active"), "cpu-dp-controller-idle": "not-needed"}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(CPU_STATES))
def test_status_with_cpu_engine_is_all_good(variant):
    r, report, states = patches_status(variant, "cpu", SGLANG_USE_CPU_ENGINE="1")
    assert {n: s for n, s in states.items() if s != "idle"} == CPU_STATES[variant], states
    assert r.returncode == 0 and report["ok"], r.stderr[-2000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", list(MATRIX))
def test_plugin_registers_the_variant_fixes(variant):
    res = results(variant)
    assert res["plugin"]["_meta"]["registered"] == expect(variant)["registered"]
    assert res["none"]["_meta"]["registered"] == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant,fix", cases("fixes"))
def test_fix_on_variant(variant, fix):
    res = results(variant)
    for name, needle in expect(variant)["fixes"][fix].items():
        stock, fixed = res["none"][name], res["plugin"][name]
        assert not stock["ok"] and needle in stock["detail"], f"{name}: stock SGLang {variant}: {stock}"
        assert fixed["ok"], f"{name}: still wrong with the plugin: {fixed}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant,guard", cases("guards"))
def test_guard_on_variant(variant, guard):
    res = results(variant)
    for state in ("none", "plugin"):
        assert res[state][guard]["ok"], f"{state}: {res[state][guard]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant,scenario", cases("latent"))
def test_latent_defect_on_variant(variant, scenario):
    """A defect shape that no supported configuration reaches (a `not-needed` fix, its guards say
    why): it shows with and without the plugin, with the specific error."""
    res = results(variant)
    needle = expect(variant)["latent"][scenario]
    for state in ("none", "plugin"):
        got = res[state][scenario]
        assert not got["ok"] and needle in got["detail"], f"{state}: {got}"


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
