"""The SGLang 0.5.16 diffs (`sglang_patches/diffs/0.5.16/`): they apply to the 0.5.16 wheel of the
version-matrix environment, the patched tree passes the 0.5.16 scenarios with no plugin, and the
diffs of one version refuse the other version's tree without changing it."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from scenario_runner import run_states
from test_diffs import SITE_SGLANG, digest
from test_version_matrix import expect, python_of

from sglang_patches.diffs import patches

VERSION = "0.5.16"
CLI = [sys.executable, "-m", "rollout.cli", "patches", "apply-source"]


def touched(version):
    files = set()
    for p in patches(version):
        files |= set(re.findall(r"^\+\+\+ b/python/sglang/(\S+)$", p.read_text(), re.M))
    return sorted(files)


def site_sglang(python) -> Path:
    out = subprocess.run([str(python), "-c", "import sglang, os; print(os.path.dirname(sglang.__file__))"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return Path(out.strip())


def tree(root: Path, site: Path, files, link_rest: bool) -> Path:
    """A copy of `site` holding the touched `files` (the rest symlinked when link_rest)."""
    if link_rest:
        for d, _, names in os.walk(site):
            if "__pycache__" not in d:
                out = root / "sglang" / Path(d).relative_to(site)
                out.mkdir(parents=True, exist_ok=True)
                for name in names:
                    os.symlink(Path(d) / name, out / name)
    for f in (f for f in files if (site / f).exists()):  # 0.5.16 has no graph_utils.py
        dst = root / "sglang" / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        shutil.copy(site / f, dst)
    return root


def apply(root, version):
    return subprocess.run(CLI + ["--sglang-dir", str(root), "--version", version], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(600)
def test_patched_0_5_16_tree_passes_scenarios_without_plugin(tmp_path):
    py = python_of(VERSION)
    root = tree(tmp_path, site_sglang(py), touched(VERSION), link_rest=True)
    r = apply(root, VERSION)
    assert r.returncode == 0 and r.stdout.count(": applied") == len(patches(VERSION)), r.stderr
    again = apply(root, VERSION)
    assert again.returncode == 0 and again.stdout.count("already applied") == len(patches(VERSION))
    res = run_states(["source"], script="dp_scenarios_v0_5_16.py", python=py, timeout=600,
                     extra_env={"source": {"PYTHONPATH": f"{root}{os.pathsep}{Path(__file__).parent.parent}"}})
    res = res["source"]
    assert res["_meta"]["registered"] == [] and res["_meta"]["sglang_path"].startswith(str(root))
    want = expect(VERSION)
    for name in [n for scen in want["fixes"].values() for n in scen] + want["guards"]:
        assert res[name]["ok"], f"{name}: {res[name]['detail']}"


@pytest.mark.parametrize("diffs,other", [("0.5.23", VERSION), (VERSION, "0.5.23")])
def test_other_versions_diffs_refuse_and_change_nothing(tmp_path, diffs, other):
    site = site_sglang(python_of(VERSION)) if other == VERSION else SITE_SGLANG
    root = tree(tmp_path, site, touched(diffs), link_rest=False)
    before = digest(root)
    r = apply(root, diffs)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not apply" in r.stderr, r.stderr
    assert digest(root) == before
