#!/usr/bin/env bash
# The device (H200) check, ONE command from the repo root (about 1-3 minutes):
#   bash scripts/gpu_check/run.sh
# Installs the carried wheels (.gpu/*.whl: SGLang 0.5.15.post1 --no-deps, the pure-Python/cp312 packages
# its capturer's import chain needs that the device image lacks, megatron-core 0.16.1) into $SITE, then runs
# scripts/gpu_check/checks.py: one line per check, `gpu-check NAME: PASS|FAIL|SKIP reason`; the whole log
# goes to $OUT/gpu_check.log. Dry run on CPU: PYTHON=<py3.11> WHEELS=<cp311 wheels> SITE=<tmp> OUT=<tmp>.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpu}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
{
    echo "gpu-check: $(date -u +%FT%TZ) $($PYTHON -V 2>&1) on $(nvidia-smi -L 2>/dev/null | head -1 || echo 'no nvidia-smi')"
    ls "$WHEELS"/*.whl >/dev/null || { echo "gpu-check install: FAIL no wheels in $WHEELS"; exit 1; }
    if ! timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl > "$OUT/pip.log" 2>&1; then
        grep -v "^WARNING" "$OUT/pip.log" | tail -5
        echo "gpu-check install: pip refused (above); unpacking the wheels into $SITE instead"
        for w in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$w" "$SITE"; done
    fi
    [ -d "$SITE/sglang" ] || { echo "gpu-check install: FAIL sglang not installed into $SITE"; exit 1; }
    PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 timeout 220 "$PYTHON" scripts/gpu_check/checks.py "$SITE"
    rc=$?
    [ $rc = 124 ] && echo "gpu-check: FAIL the checks ran past 220 s"
    echo "gpu-check: done rc $rc"
    exit $rc
} 2>&1 | tee "$OUT/gpu_check.log"
