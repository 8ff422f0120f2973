"""The `git apply` diffs: each variant's set applies to its tree (0.5.23 here; every other reviewed
variant in its version-matrix environment), apply-source picks the set that fits, is
idempotent and atomic, refuses edited trees, and a patched tree passes the same regression scenarios
with no plugin loaded."""
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_patches.scenarios.runner import env_python, run_states
from sglang_patches.diffs import patches, variants

SITE_SGLANG = Path(__import__("importlib.util").util.find_spec("sglang").origin).parent
PATCHES = patches("0.5.23")
CLI = [sys.executable, "-m", "rollout.cli", "patches", "apply-source"]
MATRIX = [v for v in variants() if v != "0.5.23"]


def touched_files(variant="0.5.23"):
    files = {"_version.py"}  # apply-source prefers the diff set of the tree's own version
    for p in patches(variant):
        files |= set(re.findall(r"^\+\+\+ b/python/sglang/(\S+)$", p.read_text(), re.M))
    return sorted(files)


def env_site(variant):
    """The sglang package dir of a version-matrix environment (skip when it is not built)."""
    py = env_python(variant)
    if not py.exists():
        if variant in os.environ.get("SLIME_MOE_ROLLOUT_MATRIX", "").split():
            pytest.fail(f"{py} missing")
        pytest.skip(f"no environment for SGLang {variant}")
    return next(py.parent.parent.glob("lib/python*/site-packages/sglang"))


def small_tree(root: Path, checkout: bool, variant="0.5.23", site=SITE_SGLANG) -> Path:
    """Only the files the diffs touch, in package or checkout layout."""
    base = root / "python" if checkout else root
    for f in touched_files(variant):
        dst = base / "sglang" / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / f, dst)
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
    assert r.stderr.count("\n") == 1 and "does not apply: 0.5.23: 0003-draft-extend-real-rows.patch;" in r.stderr
    assert digest(root) == before


def test_two_diffs_on_one_file_all_or_nothing(tmp_path):
    """0001 and 0004 both change forward_batch_info.py: a conflict in 0004 leaves 0001 unapplied too."""
    root = small_tree(tmp_path, checkout=False)
    f = root / "sglang/srt/model_executor/forward_batch_info.py"
    f.write_text(f.read_text().replace("ceil_align(global_num_tokens[i], attn_tp_size)",
                                       "ceil_align(global_num_tokens[i], attn_tp_size)  # local edit"))
    before = digest(root)
    r = cli("--sglang-dir", str(root), "--version", "0.5.23")
    assert r.returncode == 2
    assert "does not apply: 0.5.23: 0004-verify-padding-lcm.patch" in r.stderr
    assert digest(root) == before


@pytest.mark.parametrize("variant", MATRIX)
def test_variant_tree_gets_its_own_diff_set(tmp_path, variant):
    """apply-source tells stock 0.5.15.post1 from slime's patched tree by which set fits."""
    root = small_tree(tmp_path, checkout=False, variant=variant, site=env_site(variant))
    first = cli("--sglang-dir", str(root))
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"tree: SGLang {variant}\n")
    assert first.stdout.count(": applied") == len(patches(variant))
    second = cli("--sglang-dir", str(root))
    assert second.returncode == 0 and second.stdout.count("already applied") == len(patches(variant))


def test_slime_tree_needs_its_own_capturer_diff():
    stock, slime = patches("0.5.15.post1"), patches("0.5.15.post1+slime")
    assert [p.name for p in stock] == [p.name for p in slime]
    differ = [a.name for a, b in zip(stock, slime) if a.read_text() != b.read_text()]
    assert differ == ["0001-capturer-extent.patch"]  # slime's sglang.patch edits those model_runner lines


@pytest.mark.parametrize("args,needle", [
    (["--sglang-dir", "/nonexistent/dir"], "neither an SGLang checkout"),
    (["--sglang-dir", "/tmp", "--version", "0.5.9"], "no diffs for SGLang 0.5.9"),
    ([], "required"),
])
def test_bad_input_one_line(args, needle):
    r = cli(*args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr


def patched_copy(root, variant="0.5.23", site=SITE_SGLANG):
    """A full importable copy of an SGLang package (symlinks, touched files copied), patched."""
    for d, _, files in os.walk(site):
        if "__pycache__" in d:
            continue
        out = root / "sglang" / Path(d).relative_to(site)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.symlink(Path(d) / name, out / name)
    for f in touched_files(variant):
        (root / "sglang" / f).unlink()
        shutil.copy(site / f, root / "sglang" / f)
    r = cli("--sglang-dir", str(root))
    assert r.returncode == 0 and f"tree: SGLang {variant}\n" in r.stdout, r.stderr
    return root


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory):
    return patched_copy(tmp_path_factory.mktemp("patched"))


def _patched_variant_run(variant, base):
    """The variant's tree copied under `base`, patched, and its scenarios run there with no plugin."""
    root = patched_copy(base / variant, variant, env_site(variant))
    res = run_states(["source"], python=env_python(variant),
                     extra_env={"source": {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}},
                     timeout=580)["source"]
    return root, res


# The releases slime's and Miles' images run now (slime's, its next, Miles') in `make test`; the rest of the
# matrix in `make test-e2e` (each is a whole scenario run on a patched copy of the tree).
USER_RELEASES = ("0.5.15.post1", "0.5.15.post1+slime", "0.5.17", "0.5.19")
PATCHED_QUICK = [v for v in MATRIX if v in USER_RELEASES]
PATCHED_E2E = [v for v in MATRIX if v not in USER_RELEASES]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", PATCHED_QUICK + [pytest.param(v, marks=pytest.mark.e2e) for v in PATCHED_E2E])
def test_patched_variant_tree_passes_its_scenarios_without_plugin(tmp_path_factory, variant):
    from support.variant_runs import ahead

    base = tmp_path_factory.getbasetemp() / "patched-variants"
    order = PATCHED_QUICK if variant in PATCHED_QUICK else PATCHED_E2E
    root, res = ahead("patched-tree", lambda v: _patched_variant_run(v, base), variant, order)
    assert res["_meta"]["registered"] == [] and res["_meta"]["sglang_path"].startswith(str(root))
    _fixed_as_with_plugin(res, variant)


def _fixed_as_with_plugin(res, variant):
    """Every scenario the plugin must get right on `variant` is right on the patched tree."""
    from sglang_patches.scenarios import dp as dp_scenarios

    for name, (_, plugin_ok) in dp_scenarios.expected(variant).items():
        if plugin_ok:
            assert res[name]["ok"], f"{name}: {res[name]['detail']} {res[name].get('trace', '')}"


def test_patched_tree_passes_regression_scenarios_without_plugin(patched_site):
    res = run_states(["source"], extra_env={"source": {"PYTHONPATH": str(patched_site)}})["source"]
    assert res["_meta"]["registered"] == []
    assert res["_meta"]["sglang_path"].startswith(str(patched_site))
    _fixed_as_with_plugin(res, "0.5.23")
