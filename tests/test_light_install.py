"""The package in a Python with only its declared dependencies (no torch, no SGLang: a login node where a
user checks a config before reserving GPUs) answers every command in one line.

The environment is built once per dependency list (venv + the dependencies pyproject.toml declares) under
`.venvs/light-<hash>` (or $SLIME_MOE_ROLLOUT_LIGHT_VENV) and reused; this checkout's package is installed into
it afresh for every run (`pip install --no-deps --force-reinstall` of a copy), and the commands are the installed
console script run from outside the checkout without PYTHONPATH: what a user's `pip install` gives.
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


def _pip(venv: str, *args) -> None:
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    p = subprocess.run(pip + list(args), capture_output=True, text=True)
    assert p.returncode == 0, f"pip install {' '.join(args)}: {p.stdout[-2000:]}{p.stderr[-2000:]}"


def _build(venv: str) -> None:
    tmp = venv + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
    _pip(tmp, *_deps())
    os.replace(tmp, venv)


def _install_package(venv: str, scratch: str) -> None:
    """This checkout's package, installed (not on a path) into the light env."""
    src = os.path.join(scratch, "src")  # a copy: the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "tests", "docs", "benchmarks", "scripts",
                                                             "build", "*.egg-info", "__pycache__", "runs"))
    _pip(venv, "--no-deps", "--force-reinstall", src)


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    key = hashlib.sha256("\n".join([sys.version, *_deps()]).encode()).hexdigest()[:12]
    venv = os.environ.get("SLIME_MOE_ROLLOUT_LIGHT_VENV") or os.path.join(ROOT, ".venvs", f"light-{key}")
    if not os.path.isdir(venv):
        _build(venv)
    _install_package(venv, str(tmp_path_factory.mktemp("light-src")))
    outside = str(tmp_path_factory.mktemp("light-cwd"))   # not the checkout: nothing importable from cwd
    py, script = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "slime-moe-rollout")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def cli(*args):
        p = subprocess.run([script, *args], capture_output=True, text=True, env=env, cwd=outside, timeout=120)
        return p.returncode, p.stdout, p.stderr

    probe = subprocess.run([py, "-c", "import importlib.util as u, rollout; print([m for m in ('torch', 'sglang') "
                                      "if u.find_spec(m)], rollout.__file__)"],
                           capture_output=True, text=True, env=env, cwd=outside)
    found, where = probe.stdout.split(" ", 1) if " " in probe.stdout else (probe.stdout, probe.stderr)
    assert found == "[]", f"the light env holds {probe.stdout.strip()}"
    assert where.strip().startswith(os.path.join(venv, "lib")), f"rollout is imported from {where.strip()}"
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
