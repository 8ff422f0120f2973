#!/usr/bin/env bash
# Build (or reuse) the CPU virtualenv at $VENV (default .venv/): torch 2.13.0, sglang 0.5.23 --no-deps,
# the pinned light dependencies of $LOCK, this package (editable) and, when no usable CUDA device is
# present, the CPU interpreter hook. Any failed install fails here with pip's error; the venv is stamped
# only after scripts/verify_venv.py (pip check + importing every module the project uses) passes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
LOCK=${LOCK:-requirements/cpu-lock.txt}
stamp=$(cat requirements/*.txt "$LOCK" pyproject.toml scripts/setup_venv.sh scripts/verify_venv.py | sha256sum | cut -c1-16)
if [ -f "$VENV/.stamp" ] && [ "$(cat "$VENV/.stamp")" = "$stamp" ] && "$VENV/bin/python" -c "import sglang_patches" 2>/dev/null; then
    exit 0
fi
echo "setup: building $VENV (torch 2.13.0, sglang 0.5.23, pinned deps; about 3-8 minutes)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip install, quietly; on failure print pip's whole output and stop.
pip_install() {
    local log
    log=$(mktemp)
    if ! "$VENV/bin/pip" install -q "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2 || true   # pip's own error, without mirror noise
        rm -f "$log"
        echo "setup: FAILED: pip install $*" >&2
        exit 1
    fi
    # sglang is installed --no-deps: pip's resolver notes about its pins are expected (pip check judges later)
    grep -v -e "^WARNING: Location" -e "dependency conflicts" -e "^sglang [0-9.a-z]* requires" "$log" >&2 || true
    rm -f "$log"
}

sglang_pin=$(grep '^sglang==' "$LOCK")
pip_install -c requirements/constraints.txt torch==2.13.0
pip_install --no-deps "$sglang_pin"
grep -v -e '^#' -e '^sglang==' -e '^$' "$LOCK" > "$VENV/lock-rest.txt"
pip_install -c requirements/constraints.txt -r "$VENV/lock-rest.txt"
pip_install --no-deps -e .
# No usable CUDA device (a CPU wheel, or a CUDA build of torch on a CPU machine): install the
# interpreter hook (sgl_kernel substitute, torchvision ops) before anything imports sglang.
"$VENV/bin/python" -c "
from sglang_patches.cpu import env
if env.needs_cpu_hook():
    print('setup: CPU hook at', env.install())
"
"$VENV/bin/python" - "${sglang_pin#sglang==}" <<'PY'
import importlib.metadata as md
import sys
import torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}, lock says 2.13.0"
assert md.version("sglang") == sys.argv[1], f"sglang {md.version('sglang')}, lock says {sys.argv[1]}"
PY
"$VENV/bin/python" scripts/verify_venv.py --sglang-version "${sglang_pin#sglang==}"
echo "$stamp" > "$VENV/.stamp"
echo "setup: $VENV ready"
