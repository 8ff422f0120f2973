"""The fix set as `git apply` diffs, for baking into an image instead of using the plugin.

Diffs live in `diffs/<sglang version>/NNNN-<fix>.patch`, in SGLang's repository layout
(`a/python/sglang/srt/...`), and apply in order. `apply_source` takes either an SGLang checkout
(holding `python/sglang`) or a directory holding the package (`sglang/`, e.g. site-packages).
It checks every diff first and changes nothing if any does not apply; diffs already applied
are skipped, so it is idempotent.
"""
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


class ApplyError(Exception):
    pass


def patches(version: str) -> list:
    d = HERE / version
    found = sorted(d.glob("*.patch")) if d.is_dir() else []
    if not found:
        have = sorted(p.name for p in HERE.iterdir() if p.is_dir() and not p.name.startswith("_"))
        raise ApplyError(f"no diffs for SGLang {version} (available: {', '.join(have)})")
    return found


def layout(sglang_dir: str) -> tuple:
    """(root, strip) for `git apply -p<strip>` run in root."""
    root = Path(sglang_dir).resolve()
    if (root / "python" / "sglang" / "srt").is_dir():
        return root, 1
    if (root / "sglang" / "srt").is_dir():
        return root, 2
    raise ApplyError(f"{sglang_dir}: neither an SGLang checkout (python/sglang/srt) nor a dir holding sglang/srt")


def _git_apply(root: Path, strip: int, patch: Path, *flags) -> bool:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))  # never an enclosing repo
    r = subprocess.run(["git", "apply", f"-p{strip}", *flags, str(patch)], cwd=root, env=env,
                       capture_output=True, text=True)
    return r.returncode == 0


def plan(sglang_dir: str, version: str) -> list:
    """[(patch, state)] with state 'applied', 'pending' or 'conflict'."""
    root, strip = layout(sglang_dir)
    out = []
    for p in patches(version):
        if _git_apply(root, strip, p, "--check", "--reverse"):
            out.append((p, "applied"))
        elif _git_apply(root, strip, p, "--check"):
            out.append((p, "pending"))
        else:
            out.append((p, "conflict"))
    return out


def apply_source(sglang_dir: str, version: str, check_only: bool = False):
    """Apply pending diffs; yields one line per diff. Raises ApplyError before changing anything."""
    patches(version)
    root, strip = layout(sglang_dir)
    states = plan(sglang_dir, version)
    bad = [p.name for p, s in states if s == "conflict"]
    if bad:
        raise ApplyError(f"{', '.join(bad)} does not apply to {root} (not SGLang {version}, or edited); nothing changed")
    for p, s in states:
        if s == "applied":
            yield f"{p.name}: already applied"
        elif check_only:
            yield f"{p.name}: would apply"
        else:
            if not _git_apply(root, strip, p):
                raise ApplyError(f"{p.name}: git apply failed after a clean check in {root}")
            yield f"{p.name}: applied"
