"""The fix set as `git apply` diffs, for baking into an image instead of using the plugin.

Diffs live in `diffs/<variant>/NNNN-<fix>.patch` (variant as in `registry.VARIANTS`), in SGLang's
repository layout (`a/python/sglang/srt/...`), and apply in order. A variant directory may hold a
`BASE` file naming another variant whose diffs it reuses (its own files replace same-named ones).
`apply_source` takes an SGLang checkout (holding `python/sglang`) or a directory holding the package
(`sglang/`, e.g. site-packages), picks the diff set that fits the tree (stock or slime-patched; every
diff applied or cleanly applicable), and applies what is pending in one `git apply` call: all or
nothing, also when two diffs touch one file. Diffs already applied are skipped (idempotent).
"""
import os
import subprocess
from pathlib import Path

from sglang_patches.errors import CliError

HERE = Path(__file__).resolve().parent


class ApplyError(CliError):
    """The diffs cannot be applied (one line, exit 2)."""


def variants() -> list:
    """Diff sets, in registry.VARIANTS order."""
    from sglang_patches.registry import VARIANTS

    have = {p.name for p in HERE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    return [v.name for v in VARIANTS if v.name in have] + sorted(have - {v.name for v in VARIANTS})


def patches(variant: str) -> list:
    d = HERE / variant
    found = {p.name: p for p in d.glob("*.patch")} if d.is_dir() else {}
    if (d / "BASE").is_file():
        found = {p.name: p for p in patches((d / "BASE").read_text().strip())} | found
    if not found:
        raise ApplyError(f"no diffs for SGLang {variant} (available: {', '.join(variants())})")
    return [found[name] for name in sorted(found)]


def layout(sglang_dir: str) -> tuple:
    """(root, strip) for `git apply -p<strip>` run in root."""
    root = Path(sglang_dir).resolve()
    if (root / "python" / "sglang" / "srt").is_dir():
        return root, 1
    if (root / "sglang" / "srt").is_dir():
        return root, 2
    raise ApplyError(f"{sglang_dir}: neither an SGLang checkout (python/sglang/srt) nor a dir holding sglang/srt")


def _git_apply(root: Path, strip: int, patches_, *flags) -> bool:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))  # never an enclosing repo
    r = subprocess.run(["git", "apply", f"-p{strip}", *flags, *map(str, patches_)], cwd=root, env=env,
                       capture_output=True, text=True)
    return r.returncode == 0


def plan(sglang_dir: str, variant: str) -> list:
    """[(patch, state)] with state 'applied', 'pending' or 'conflict'."""
    root, strip = layout(sglang_dir)
    out = []
    for p in patches(variant):
        if _git_apply(root, strip, [p], "--check", "--reverse"):
            out.append((p, "applied"))
        elif _git_apply(root, strip, [p], "--check"):
            out.append((p, "pending"))
        else:
            out.append((p, "conflict"))
    return out


def tree_version(sglang_dir: str):
    """The version a wheel's tree records (`sglang/_version.py`), or None (a checkout, a partial tree)."""
    import re

    root, strip = layout(sglang_dir)
    f = root / ("python/sglang" if strip == 1 else "sglang") / "_version.py"
    m = re.search(r"^__version__ = (?:version = )?['\"]([^'\"]+)['\"]", f.read_text(), re.M) if f.is_file() else None
    return m.group(1) if m else None


def choose(sglang_dir: str, wanted=None) -> tuple:
    """(variant, plan) of the first diff set that fits the tree, those of the tree's own version first
    (several releases share identical diffs); `wanted` narrows to a version or variant."""
    names = [n for n in variants() if wanted in (None, n, n.split("+")[0])]
    if not names:
        patches(wanted)  # raises: no diffs for it
    own = tree_version(sglang_dir)
    names.sort(key=lambda n: n.split("+")[0] != own)  # stable: VARIANTS order within each group
    root, _ = layout(sglang_dir)
    misfits = []
    for name in names:
        states = plan(sglang_dir, name)
        bad = [p.name for p, s in states if s == "conflict"]
        if not bad:
            return name, states
        misfits.append(f"{name}: {', '.join(bad)}")
    raise ApplyError(f"no diff set fits {root} (does not apply: {'; '.join(misfits)}); nothing changed")


def apply_source(sglang_dir: str, version=None, check_only: bool = False):
    """Apply pending diffs; yields one line per diff. Raises ApplyError before changing anything."""
    variant, states = choose(sglang_dir, version)
    root, strip = layout(sglang_dir)
    yield f"tree: SGLang {variant}"
    pending = [p for p, s in states if s == "pending"]
    if pending and not check_only:
        if not _git_apply(root, strip, pending, "--check"):
            raise ApplyError(f"{', '.join(p.name for p in pending)} do not apply together to {root}; nothing changed")
        if not _git_apply(root, strip, pending):
            raise ApplyError(f"git apply failed after a clean check in {root}")
    for p, s in states:
        yield f"{p.name}: " + ("already applied" if s == "applied" else "would apply" if check_only else "applied")
