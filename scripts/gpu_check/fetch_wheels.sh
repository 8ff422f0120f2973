#!/usr/bin/env bash
# Download the device check's carried wheels (scripts/gpu_check/wheels.txt) into .gpu/ (ignored by git),
# for the device's Python 3.12 on x86-64, then check every file and size and that the carry (these
# wheels + the working tree) fits the device tool's 64 MiB. Run on the CPU machine, from anywhere:
#   bash scripts/gpu_check/fetch_wheels.sh            # about 1 minute, 50 MB
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=${DEST:-.gpu}
LIST=scripts/gpu_check/wheels.txt
mkdir -p "$DEST"
reqs=$(grep -v '^#' "$LIST" | awk 'NF {print $1}')
platforms=""
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
         manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms="$platforms --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 $platforms -d "$DEST" $reqs 2>&1 | { grep -v "^WARNING: Location" || true; }
"$PYTHON" scripts/gpu_check/plan.py check-carry "$DEST"
