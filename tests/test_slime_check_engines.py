"""scripts/check_against_slime.sh against engines of another reviewed SGLang version.

slime's own client code (its discovery, router, `SGLangEngine.init`, `generate_rollout`, train-data
conversion with R3 validation, replay preparation) against `serve`'s engines of that version, and plugin
mode's rollout with routed experts through the same checks. Needs a slime checkout ($SLIME_SRC), slime's
client Python ($SLIME_PYTHON, see the script) and the version's environment
(scripts/setup_sglang_env.sh VERSION, or $SLIME_CHECK_ENGINE_ENV_<VERSION with _ for . and +>).
The caller holds /tmp/engine.lock (as for every engine test): the script is told not to take it.
"""
import os
import subprocess

import pytest

from sglang_patches.scenarios.runner import env_python

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1200)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_LINES = ("[ok] rollout.slime.generate_rollout -> the workers slime's router lists (plugin mode)",
                "[ok] slime's replay preparation on plugin mode's routed experts",
                "[ok] plugin mode's routed experts == transformers' router top-k")


def _env_dir(version: str) -> str:
    key = "SLIME_CHECK_ENGINE_ENV_" + version.replace(".", "_").replace("+", "_")
    return os.environ.get(key) or str(env_python(version).parents[1])


@pytest.mark.parametrize("version", ["0.5.15.post1", "0.5.16"])
def test_slime_checks_pass_against_engines_of(version):
    slime_src = os.environ.get("SLIME_SRC", "")
    slime_python = os.environ.get("SLIME_PYTHON", "/tmp/venv-slime/bin/python")
    env_dir = _env_dir(version)
    if not os.path.isdir(os.path.join(slime_src, "slime")):
        pytest.skip("no slime checkout: set SLIME_SRC (THUDM/slime 624b824)")
    if not os.path.exists(slime_python):
        pytest.skip(f"no slime client Python at {slime_python} (see scripts/check_against_slime.sh)")
    if not os.path.exists(os.path.join(env_dir, "bin", "python")):
        pytest.skip(f"{env_dir} missing: build it with scripts/setup_sglang_env.sh {version}")
    p = subprocess.run([os.path.join(REPO, "scripts", "check_against_slime.sh"), "--engine-env", env_dir, slime_src],
                       env=dict(os.environ, ENGINE_LOCK="", SLIME_PYTHON=slime_python), capture_output=True,
                       text=True, timeout=1100)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    assert f"(engines: SGLang {version} from " in out, out[:500]
    for line in PLUGIN_LINES:
        assert line in out, f"missing {line!r}:\n{out[-3000:]}"
    assert "routed experts [(" in out.split(PLUGIN_LINES[0])[1].splitlines()[0]   # non-empty R3 per sample
    assert "[FAILED]" not in out
