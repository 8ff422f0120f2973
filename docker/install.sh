#!/usr/bin/env bash
# Install slime-moe-rollout into an image's (or any environment's) Python, then check that every
# SGLang fix is active for the installed SGLang. Used by docker/Dockerfile and by CI on CPU.
#
#   docker/install.sh [--src DIR] [--python PY] [--allow-refused] [--dry-run]
#
#   --src DIR         source tree to install (default: the repository holding this script)
#   --python PY       interpreter of the target environment (default: python3)
#   --allow-refused   print the fix status but do not fail when a fix is refused
#   --dry-run         print the commands instead of running them
#
# torch and SGLang are never installed or changed: they come from the base image. A base whose SGLang
# is not a reviewed variant (every release 0.5.15.post1 ... 0.5.23, and 0.5.15.post1 + slime's patches)
# makes `patches status` refuse, and this script fail.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="python3"
ALLOW_REFUSED=0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --src) SRC="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --allow-refused) ALLOW_REFUSED=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

run() {
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

[ -f "$SRC/pyproject.toml" ] || { echo "install.sh: $SRC has no pyproject.toml" >&2; exit 2; }
command -v "$PY" >/dev/null 2>&1 || { echo "install.sh: python not found: $PY" >&2; exit 2; }
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { echo "install.sh: slime-moe-rollout needs Python >= 3.11 ($PY is $("$PY" -V 2>&1))" >&2; exit 2; }
SGLANG_VERSION="$("$PY" -c 'from importlib.metadata import version; print(version("sglang"))' 2>/dev/null || echo none)"
echo "install.sh: python $("$PY" -c 'import platform; print(platform.python_version())'), sglang $SGLANG_VERSION"

# Build with the image's own setuptools when it can build a wheel (>= 70.1, or older plus `wheel`);
# otherwise let pip fetch a build backend (needs an index).
BUILD_FLAGS=(--no-build-isolation)
"$PY" - <<'PYEOF' || BUILD_FLAGS=()
import importlib.util, sys
import setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
sys.exit(0 if v >= (70, 1) or (v >= (64, 0) and importlib.util.find_spec("wheel")) else 1)
PYEOF

# Light dependencies only (pyproject lists no torch/sglang); already-satisfied pins of the image stay.
run "$PY" -m pip install --no-cache-dir "${BUILD_FLAGS[@]}" "$SRC"

# The gate: every fix for this SGLang must be active (or upstream / not-needed / absent / idle here).
if [ "$ALLOW_REFUSED" = 1 ]; then
  run "$PY" -m rollout.cli patches status || echo "install.sh: fixes not active (allowed by --allow-refused)"
else
  run "$PY" -m rollout.cli patches status
fi
echo "install.sh: done"
