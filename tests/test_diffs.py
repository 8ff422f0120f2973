"""The `git apply` diffs: they apply to SGLang 0.5.23, are idempotent, refuse edited trees,
and a patched tree passes the same regression scenarios with no plugin loaded."""
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_patches.diffs import patches

SITE_SGLANG = Path(__import__("importlib.util").util.find_spec("sglang").origin).parent
PATCHES = patches("0.5.23")
CLI = [sys.executable, "-m", "rollout.cli", "patches", "apply-source"]


def touched_files():
    files = set()
    for p in PATCHES:
        files |= set(re.findall(r"^\+\+\+ b/python/sglang/(\S+)$", p.read_text(), re.M))
    return sorted(files)


def small_tree(root: Path, checkout: bool) -> Path:
    """Only the files the diffs touch, in package or checkout layout."""
    base = root / "python" if checkout else root
    for f in touched_files():
        dst = base / "sglang" / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE_SGLANG / f, dst)
    return root


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def cli(*args):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("checkout", [False, True], ids=["package-layout", "checkout-layout"])
def test_apply_is_idempotent(tmp_path, checkout):
    root = small_tree(tmp_path, checkout)
    first = cli("--sglang-dir", str(root))
    assert first.returncode == 0, first.stderr
    assert first.stdout.count(": applied") == len(PATCHES)
    after = digest(root)
    second = cli("--sglang-dir", str(root))
    assert second.returncode == 0 and second.stdout.count("already applied") == len(PATCHES)
    assert digest(root) == after


def test_half_applied_tree_is_completed(tmp_path):
    root = small_tree(tmp_path, checkout=False)
    subprocess.run(["git", "apply", "-p2", str(PATCHES[0])], cwd=root, check=True,
                   env=dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent)))
    r = cli("--sglang-dir", str(root))
    assert r.returncode == 0, r.stderr
    assert f"{PATCHES[0].name}: already applied" in r.stdout and r.stdout.count(": applied") == len(PATCHES) - 1


def test_edited_tree_is_refused_and_left_unchanged(tmp_path):
    root = small_tree(tmp_path, checkout=False)
    f = root / "sglang/srt/layers/attention/graph_utils.py"
    f.write_text(f.read_text().replace("if not mode.is_extend() or mode.is_target_verify():",
                                       "if not mode.is_extend():  # local edit"))
    before = digest(root)
    r = cli("--sglang-dir", str(root))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "0003-draft-extend-real-rows.patch does not apply" in r.stderr
    assert digest(root) == before


@pytest.mark.parametrize("args,needle", [
    (["--sglang-dir", "/nonexistent/dir"], "neither an SGLang checkout"),
    (["--sglang-dir", "/tmp", "--version", "0.5.9"], "no diffs for SGLang 0.5.9"),
    ([], "required"),
])
def test_bad_input_one_line(args, needle):
    r = cli(*args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory):
    """A full importable copy of the installed SGLang (symlinks, touched files copied), patched."""
    root = tmp_path_factory.mktemp("patched")
    for d, _, files in os.walk(SITE_SGLANG):
        if "__pycache__" in d:
            continue
        out = root / "sglang" / Path(d).relative_to(SITE_SGLANG)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.symlink(Path(d) / name, out / name)
    for f in touched_files():
        (root / "sglang" / f).unlink()
        shutil.copy(SITE_SGLANG / f, root / "sglang" / f)
    r = cli("--sglang-dir", str(root))
    assert r.returncode == 0, r.stderr
    return root


def test_patched_tree_passes_regression_scenarios_without_plugin(patched_site):
    from scenario_runner import run_states
    from test_dp_fixes import FIX_SCENARIOS, GUARD_SCENARIOS

    res = run_states(["source"], extra_env={"source": {"PYTHONPATH": str(patched_site)}})["source"]
    assert res["_meta"]["registered"] == []
    assert res["_meta"]["sglang_path"].startswith(str(patched_site))
    for name in [n for names in FIX_SCENARIOS.values() for n in names] + GUARD_SCENARIOS:
        assert res[name]["ok"], f"{name}: {res[name]['detail']}"
