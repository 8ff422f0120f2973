#!/usr/bin/env bash
# The device (H200) check, ONE command from the repo root (at most 8 minutes):
#   bash scripts/gpu_check/run.sh [all|engine|basic]          (default all)
# 1. Installs exactly the carried wheels of scripts/gpu_check/wheels.txt from .gpu/ (SGLang 0.5.15.post1
#    --no-deps, its server's pure-Python/cp312 packages the device image lacks, megatron-core 0.16.1) into
#    $SITE, and puts scripts/gpu_check/sitecustomize.py there: every process then serves `sgl_kernel` from
#    the package's torch substitute and, with GPU_CHECK_KERNELS=torch (default; `jit`: SGLang's own nvcc
#    JIT kernels), replaces SGLang's JIT kernels by torch ops (scripts/gpu_check/kernel_shim.py).
# 2. engine: real SGLang engines on the GPU (scripts/gpu_check/engine_checks.py; the retraction check among
#    them), budget 265 s (at most 290).
# 3. basic: the CUDA-stream / megatron / CUDA-branch / kernel-op checks (scripts/gpu_check/checks.py), at most 100 s.
# One line per check, `gpu-check NAME: PASS|FAIL|SKIP reason`; everything goes to $OUT/gpu_check.log,
# the engine logs are copied to $OUT/engine-*.log (8 files in all come back: the device tool's limit). The wheels are fetched on
# the CPU machine first: bash scripts/gpu_check/fetch_wheels.sh (see scripts/gpu_check/README.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
PART=${1:-all}
case "$PART" in all|engine|basic) ;; *) echo "usage: $0 [all|engine|basic]" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpu}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gpu_check_out}
WORK=${WORK:-/tmp/gpu_check_work}  # the tiny model, engine logs (copied to $OUT at the end), secret configs
export GPU_CHECK_KERNELS=${GPU_CHECK_KERNELS:-torch}
case "$GPU_CHECK_KERNELS" in torch|jit) ;; *) echo "run.sh: GPU_CHECK_KERNELS=$GPU_CHECK_KERNELS: choose torch or jit" >&2; exit 2 ;; esac
mkdir -p "$OUT"
{
    echo "gpu-check: $(date -u +%FT%TZ) $($PYTHON -V 2>&1) on $(nvidia-smi -L 2>/dev/null | head -1 || echo 'no nvidia-smi');" \
         "part $PART, kernels $GPU_CHECK_KERNELS, nvcc $(command -v nvcc || echo none)"
    t0=$SECONDS
    timeout 90 "$PYTHON" scripts/gpu_check/plan.py install "$WHEELS" "$SITE" "$OUT/pip.log" \
        || { echo "gpu-check install: FAIL (above; pip's log: $OUT/pip.log)"; exit 1; }
    [ -d "$SITE/sglang" ] || { echo "gpu-check install: FAIL sglang not installed into $SITE"; exit 1; }
    cp scripts/gpu_check/sitecustomize.py "$SITE/sitecustomize.py"
    echo "gpu-check install: PASS $(grep -vc -e '^#' -e '^$' scripts/gpu_check/wheels.txt) wheels in $((SECONDS - t0)) s"
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 GPU_CHECK_SHIM="$PWD/scripts/gpu_check/kernel_shim.py"
    rc=0
    if [ "$PART" != basic ]; then
        timeout -k 10 290 "$PYTHON" scripts/gpu_check/engine_checks.py --work "$WORK" --budget 265 || rc=$?
        [ $rc = 124 ] && echo "gpu-check engine: FAIL the engine checks ran past 290 s"
        cp "$WORK"/engine-*.log "$OUT"/ 2>/dev/null
    fi
    if [ "$PART" != engine ]; then
        timeout -k 5 100 "$PYTHON" scripts/gpu_check/checks.py "$SITE"; r=$?
        [ $r = 124 ] && echo "gpu-check basic: FAIL the checks ran past 100 s"
        [ $r != 0 ] && rc=$r
    fi
    echo "gpu-check: done rc $rc in $SECONDS s"
    exit $rc
} 2>&1 | tee "$OUT/gpu_check.log"
