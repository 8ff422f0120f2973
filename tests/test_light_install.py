"""The package in a Python with only its declared dependencies (no torch, no SGLang: a login node where a
user checks a config before reserving GPUs) answers every command in one line.

The environment is built once per dependency list (venv + `pip install --no-deps` of the package + the
dependencies pyproject.toml declares) under `.venvs/light-<hash>` (or $SLIME_MOE_ROLLOUT_LIGHT_VENV) and
reused; the commands run this checkout's code (PYTHONPATH), as the engine tests do.
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(ROOT, "training_configs", "glm4.5-355b-a32b.yaml")


def _deps() -> list:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def _build(venv: str) -> None:
    tmp = venv + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
    src = os.path.join(tmp, "src")  # a copy: the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "tests", "docs", "benchmarks", "scripts",
                                                             "build", "*.egg-info", "__pycache__", "runs"))
    pip = [os.path.join(tmp, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for args in (["--no-deps", src], _deps()):
        p = subprocess.run(pip + args, capture_output=True, text=True)
        assert p.returncode == 0, f"pip install {' '.join(args)}: {p.stdout[-2000:]}{p.stderr[-2000:]}"
    shutil.rmtree(src)
    os.replace(tmp, venv)


@pytest.fixture(scope="module")
def light():
    key = hashlib.sha256("\n".join([sys.version, *_deps()]).encode()).hexdigest()[:12]
    venv = os.environ.get("SLIME_MOE_ROLLOUT_LIGHT_VENV") or os.path.join(ROOT, ".venvs", f"light-{key}")
    if not os.path.isdir(venv):
        _build(venv)
    py = os.path.join(venv, "bin", "python")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("VIRTUAL_ENV", None)

    def cli(*args):
        p = subprocess.run([py, "-m", "rollout.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=120)
        return p.returncode, p.stdout, p.stderr

    probe = subprocess.run([py, "-c", "import importlib.util as u; print([m for m in ('torch', 'sglang') "
                                      "if u.find_spec(m)])"], capture_output=True, text=True, env=env)
    assert probe.stdout.strip() == "[]", f"the light env holds {probe.stdout.strip()}"
    return cli


@pytest.mark.timeout(900)  # the first build of the environment (about a minute from the local index)
def test_patches_status_says_sglang_is_missing(light):
    rc, out, err = light("patches", "status")
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and err.startswith("error: SGLang is not installed"), err


def test_config_check_without_sglang(light):
    rc, out, err = light("config", "check", "--no-sglang", SEED)
    assert rc == 0, err
    assert out.startswith("glm4.5-355b-a32b: OK") and "derived by ours" in out, out
    rc, out, err = light("config", "check", SEED)
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert "SGLang is not installed" in err and "--no-sglang" in err, err


def test_render_and_plan_keep_working(light):
    rc, out, err = light("config", "render", SEED, "--format", "sglang-args")
    assert rc == 0 and "--enable-dp-attention" in out, err
    rc, out, err = light("engine", "plan", "--config", SEED)
    assert rc == 0 and "sglang.launch_server" in out, err


def test_broken_config_is_one_line(light, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(SEED).read().replace("tp: 32", "tp: thirty-two", 1))
    rc, out, err = light("config", "check", "--no-sglang", str(bad))
    assert rc == 2 and err.count("\n") == 1, (rc, err)
    assert err.startswith("error: bad.yaml: engine_groups[0].tp:"), err
