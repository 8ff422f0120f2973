#!/usr/bin/env bash
# Build (or reuse) the CPU virtualenv at .venv/: torch 2.13.0 (CPU), sglang 0.5.23 --no-deps,
# the pinned light dependencies, this package (editable) and the CPU interpreter hook.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
stamp=$(cat requirements/*.txt pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16)
if [ -f .venv/.stamp ] && [ "$(cat .venv/.stamp)" = "$stamp" ] && .venv/bin/python -c "import sglang_patches" 2>/dev/null; then
    exit 0
fi
echo "setup: building .venv (torch 2.13.0 CPU, sglang 0.5.23, pinned deps; about 3 minutes)"
rm -rf .venv
"$PY" -m venv .venv
pip=".venv/bin/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
$pip install -q -c requirements/constraints.txt torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
$pip install -q --no-deps "$(grep '^sglang==' requirements/cpu-lock.txt)" 2>&1 | grep -v "^WARNING: Location" || true
grep -v -e '^#' -e '^sglang==' -e '^$' requirements/cpu-lock.txt > .venv/lock-rest.txt
$pip install -q -c requirements/constraints.txt -r .venv/lock-rest.txt 2>&1 | grep -v -e "^WARNING: Location" -e "sglang 0.5.23 requires" -e "dependency conflicts" || true
$pip install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
# CPU-only torch: install the interpreter hook (sgl_kernel substitute, torchvision ops) first.
.venv/bin/python - <<'PY'
import torch
if torch.version.cuda is None:
    from sglang_patches.cpu import env
    print("setup: CPU hook at", env.install())
PY
.venv/bin/python - <<'PY'
import importlib.metadata as md
import torch
import sglang  # noqa: F401 - must import cleanly
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert md.version("sglang") == "0.5.23"
PY
echo "$stamp" > .venv/.stamp
echo "setup: .venv ready"
