#!/usr/bin/env bash
# slime's own code against `slime-moe-rollout serve` (managed mode) and the plugin adapter.
#
#   scripts/check_against_slime.sh [--engine-env ENV] SLIME_SRC
#
# SLIME_SRC: a THUDM/slime checkout (tested: 624b824). SLIME_PYTHON (default /tmp/venv-slime/bin/python):
# a Python whose SGLang slime supports (0.5.15.post1: slime's _compute_server_args needs a dataclass
# ServerArgs) with slime's client deps (ray, httpx, pylatexenc, sglang-router), e.g. built as
#   python3.11 -m venv --without-pip /tmp/venv-slime; D=/tmp/venv-slime/client-deps
#   .venv/bin/python -m pip install --no-deps --target $D sglang==0.5.15.post1 transformers==5.12.1 \
#     tokenizers==0.22.2 pylatexenc sglang-router==0.3.2
#   SP=/tmp/venv-slime/lib/python3.11/site-packages; echo $D > $SP/00_client_deps.pth
#   echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" > $SP/zz_project.pth
# (.pth files load in name order: the pinned packages win over this project's venv, whose own .pth
# files addsitedir runs). wandb, which slime only imports, is replaced by a clearly named stub when
# missing. `serve` and its engines run from this project's venv, or with --engine-env ENV from that
# environment of another reviewed SGLang version (ENV/bin/python; scripts/setup_sglang_env.sh VERSION
# builds .venvs/sglang-VERSION), so the same checks run against engines of each version. The script
# holds $ENGINE_LOCK (/tmp/engine.lock) while engines run; ENGINE_LOCK= (empty) when the caller holds it.
# DRIVER (default check_against_slime.py): the client script run against the engines (scripts/check_parity.sh
# runs check_parity.py on the same start-up).
set -euo pipefail
USAGE="usage: scripts/check_against_slime.sh [--engine-env ENV] SLIME_SRC"
ENGINE_PYTHON=${ENGINE_PYTHON:-}
if [ "${1:-}" = "--engine-env" ]; then
  [ -n "${2:-}" ] || { echo "error: --engine-env needs an environment directory; $USAGE" >&2; exit 2; }
  [ -d "$2" ] || { echo "error: --engine-env $2: no such directory" >&2; exit 2; }
  ENGINE_PYTHON=$(cd "$2" && pwd)/bin/python   # absolute: the version probe below runs from /
  [ -x "$ENGINE_PYTHON" ] || { echo "error: --engine-env $2: no $ENGINE_PYTHON" >&2; exit 2; }
  shift 2
fi
SLIME_SRC=${1:?$USAGE}
[ -d "$SLIME_SRC/slime" ] || { echo "error: $SLIME_SRC has no slime/ package" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
SLIME_PYTHON=${SLIME_PYTHON:-/tmp/venv-slime/bin/python}
ENGINE_PYTHON=${ENGINE_PYTHON:-$ROOT/.venv/bin/python}
CONFIG=${CONFIG:-$ROOT/training_configs/tiny-cpu.yaml}
BUDGET_S=${BUDGET_S:-600}
WORK=$(mktemp -d)
SERVE_PID=
cleanup() {
  if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
    kill -TERM "$SERVE_PID"; wait "$SERVE_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

STUBS=$WORK/stubs
if ! PYTHONPATH="$SLIME_SRC" "$SLIME_PYTHON" -c "import wandb" 2>/dev/null; then
  mkdir -p "$STUBS/wandb"
  echo '"""STUB (check_against_slime.sh): wandb is not installed; slime only imports it here."""' \
    > "$STUBS/wandb/__init__.py"
fi
export PYTHONPATH="$ROOT:$ROOT/scripts:$SLIME_SRC:$STUBS"
"$SLIME_PYTHON" -c "import sglang, slime.ray.rollout; print('slime client: SGLang', sglang.__version__)" 2>/dev/null \
  || { echo "error: SLIME_PYTHON $SLIME_PYTHON cannot import sglang and slime" \
            "(this script's header says how to build it)" >&2; exit 2; }

ENGINE_SGLANG=$(cd / && PYTHONPATH="$ROOT" "$ENGINE_PYTHON" -c 'import sglang; print(sglang.__version__)' 2>&1 | tail -1)
echo "serve: $CONFIG (engines: SGLang $ENGINE_SGLANG from $ENGINE_PYTHON)"
ENGINE_LOCK=${ENGINE_LOCK-/tmp/engine.lock}   # empty: the caller already holds it (e2e tests)
if [ -n "$ENGINE_LOCK" ]; then
  exec 9>"$ENGINE_LOCK"   # the global engine lock, held by this script until it exits
  flock 9
fi
PYTHONPATH="$ROOT" "$ENGINE_PYTHON" -m rollout.cli serve --config "$CONFIG" \
  --log-dir "$WORK/logs" > "$WORK/addrs" 2> "$WORK/serve.err" &
SERVE_PID=$!
end=$((SECONDS + BUDGET_S))
while [ ! -s "$WORK/addrs" ]; do
  if ! kill -0 "$SERVE_PID" 2>/dev/null || [ $SECONDS -ge $end ]; then
    echo "error: serve did not print its addresses within ${BUDGET_S} s" >&2; tail -20 "$WORK/serve.err" >&2; exit 1
  fi
  sleep 2
done
ADDRS=$(head -1 "$WORK/addrs")
grep -E '^(ready|WARNING)' "$WORK/serve.err" || true
MODEL=$(PYTHONPATH="$ROOT" "$ENGINE_PYTHON" -c "from rollout import config as c; print(c.load('$CONFIG').model_path())")
DRIVER=${DRIVER:-check_against_slime.py}
ENGINE_PYTHON="$ENGINE_PYTHON" timeout "$BUDGET_S" "$SLIME_PYTHON" "$ROOT/scripts/$DRIVER" "$CONFIG" "$MODEL" $ADDRS \
  2>"$WORK/client.err" > "$WORK/client.out" || rc=$?
grep -E '^\[(ok|FAILED|GAP|equal|explained|DIFF|note)\]' "$WORK/client.out" || true   # slime's router logs to stdout too
if [ "${rc:-0}" != 0 ]; then tail -30 "$WORK/client.err" >&2; exit 1; fi
echo "all slime checks passed against $ADDRS ($DRIVER)"
