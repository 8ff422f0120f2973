"""Verify a freshly built virtualenv before scripts/setup_venv.sh stamps it.

1. `pip check`: every line must be about sglang's own requirements (sglang is installed with
   --no-deps on purpose, so its unmet or differing pins are expected); any other line fails.
2. Every third-party module the project imports (found by reading its sources) must import.
Exit 0 when both hold, else print each problem on one line and exit 1.

    python scripts/verify_venv.py [--sglang-version 0.5.23]
"""
import argparse
import ast
import importlib
import os
import re
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ("sglang_patches", "rollout", "training_configs", "tests", "benchmarks", "scripts")
# Imported by the project but not part of the lock: slime (with its train.py and train_async.py scripts) is the user's
# source tree (--slime-src); sglang_router is the router slime's environment brings
# (scripts/probe_router_fields.py probes it). pyarrow is optional (`run --prompts` reads Parquet when it is installed). Modules that tests write
# into a temporary folder before importing them are not installed anywhere.
NOT_IN_LOCK = {"slime", "train", "train_async", "sglang_router", "pyarrow", "in_place_target", "in_place_user",
               "slime_rollout_changed"}
# Used by the project without an import statement in its sources.
EXTRA_MODULES = ("pytest_timeout",)


def unexpected_pip_check(output: str, sglang_version: str) -> list:
    """The lines of `pip check` output that are not sglang's own requirement lines."""
    ok = re.compile(rf"^sglang {re.escape(sglang_version)} (requires |has requirement )")
    return [ln for ln in output.splitlines()
            if ln.strip() and not ok.match(ln) and ln.strip() != "No broken requirements found."]


def _local_names(root: str) -> set:
    names = set()
    for d in SOURCE_DIRS:
        names.add(d)
        for _, dirs, files in os.walk(os.path.join(root, d)):
            names.update(f[:-3] for f in files if f.endswith(".py"))
            names.update(dirs)
    return names


def third_party_imports(root: str = ROOT) -> dict:
    """{top-level module: sorted dotted names imported} over the project's absolute imports,
    without the standard library and the project's own modules."""
    local, out = _local_names(root), {}
    for d in SOURCE_DIRS:
        for base, _, files in os.walk(os.path.join(root, d)):
            for f in (f for f in files if f.endswith(".py")):
                with open(os.path.join(base, f)) as fh:
                    tree = ast.parse(fh.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        full = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        full = [node.module]
                    else:
                        continue
                    for name in full:
                        top = name.split(".")[0]
                        if top not in sys.stdlib_module_names and top not in local and top not in NOT_IN_LOCK:
                            out.setdefault(top, set()).add(name)
    for m in EXTRA_MODULES:
        out.setdefault(m, set()).add(m)
    return {k: sorted(v) for k, v in sorted(out.items())}


def import_problems(modules: dict) -> list:
    """One line per module that does not import. A namespace package (no __file__, e.g. megatron)
    proves nothing by itself, so the dotted names the project uses under it are imported too."""
    bad = []
    for top, names in modules.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. megatron-core: "Transformer Engine and Apex are not installed"
                mod = importlib.import_module(top)
                if getattr(mod, "__file__", None) is None:
                    for name in names:
                        importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            bad.append(f"import {top}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-version", default="0.5.23")
    a = ap.parse_args(argv)
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [f"pip check: {ln}" for ln in unexpected_pip_check(check.stdout + check.stderr, a.sglang_version)]
    mods = third_party_imports()
    problems += import_problems(mods)
    for p in problems:
        print(f"setup: {p}", file=sys.stderr)
    if problems:
        print(f"setup: venv verification FAILED ({len(problems)} problem(s)); not stamped", file=sys.stderr)
        return 1
    print(f"setup: verified (pip check clean apart from sglang's --no-deps pins; {len(mods)} modules import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
