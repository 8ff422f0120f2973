#!/usr/bin/env bash
# Build (or reuse) the environment of one extra reviewed SGLang variant at .venvs/sglang-<VARIANT>/.
#
#   scripts/setup_sglang_env.sh VARIANT          e.g. 0.5.15.post1, 0.5.15.post1+slime, 0.5.16
#
# A venv holding only requirements/sglang-<VERSION>.txt (installed --no-deps: that SGLang wheel and the
# few pins that differ), whose site-packages come before .venv's (a .pth adds .venv's afterwards): torch,
# the light deps, this package's entry point and the CPU hook all come from .venv. Wheels are cached in
# .venvs/wheels/. The "+slime" variant also applies slime's SGLang image patches to the installed tree:
# SLIME_SRC must name a slime checkout (docker/patch/latest/sglang*.patch); nothing of slime is committed.
# Reused while the pins, this script, .venv's stamp (and slime's patches) are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:?usage: scripts/setup_sglang_env.sh VARIANT (e.g. 0.5.15.post1 or 0.5.15.post1+slime)}
VERSION=${VARIANT%%+*}
EXTRA=${VARIANT#"$VERSION"}
PINS=requirements/sglang-$VERSION.txt
SLIME_PATCHES=(sglang.patch sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch sglang-deterministic.patch)
[ -f "$PINS" ] || { echo "setup_sglang_env: no $PINS (SGLang $VERSION has no environment)" >&2; exit 2; }
case "$EXTRA" in
  "") ;;
  +slime)
    PATCH_DIR=${SLIME_SRC:?setup_sglang_env: $VARIANT needs SLIME_SRC=<slime checkout>}/docker/patch/latest
    for p in "${SLIME_PATCHES[@]}"; do
      [ -f "$PATCH_DIR/$p" ] || { echo "setup_sglang_env: $PATCH_DIR/$p not found" >&2; exit 2; }
    done ;;
  *) echo "setup_sglang_env: unknown variant suffix '$EXTRA' (known: +slime)" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || { echo "setup_sglang_env: .venv is missing: run scripts/setup_venv.sh first" >&2; exit 2; }
ENV=.venvs/sglang-$VARIANT
# The stamp names this checkout too: an env copied from (or built by) another clone links that clone's .venv.
stamp=$( { cat "$PINS" scripts/setup_sglang_env.sh .venv/.stamp 2>/dev/null; pwd -P
           if [ -n "$EXTRA" ]; then for p in "${SLIME_PATCHES[@]}"; do cat "$PATCH_DIR/$p"; done; fi; } \
         | sha256sum | cut -c1-16)
if [ -f "$ENV/.stamp" ] && [ "$(cat "$ENV/.stamp")" = "$stamp" ]; then
    exit 0
fi
echo "setup: building $ENV (SGLang $VERSION --no-deps over .venv$EXTRA)"
rm -rf "$ENV"
.venv/bin/python -m venv --without-pip "$ENV"
SP=$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MAIN_SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }  # pip's own status is kept (pipefail)
mkdir -p .venvs/wheels
grep -v -e '^#' -e '^$' "$PINS" > "$ENV/pins.txt"
install() { quiet .venv/bin/python -m pip install -q --no-deps --no-index --find-links .venvs/wheels --target "$SP" -r "$ENV/pins.txt"; }
if ! install >/dev/null 2>&1; then  # wheels not cached yet
    quiet .venv/bin/python -m pip download -q --no-deps -d .venvs/wheels -r "$ENV/pins.txt"
    install
fi
# .venv's packages after this env's own; addsitedir also runs .venv's .pth files (CPU hook, editable install).
echo "import site; site.addsitedir('$(cd "$MAIN_SP" && pwd -P)')" > "$SP/zz_main_venv.pth"
if [ "$EXTRA" = "+slime" ]; then
    export GIT_CEILING_DIRECTORIES=$(dirname "$SP")  # not inside this repository: git apply would skip paths
    for p in "${SLIME_PATCHES[@]}"; do  # slime's Dockerfile: --check first, then apply, in this order
        git -C "$SP" apply -p2 --check --include='sglang/srt/*' "$PATCH_DIR/$p"
        git -C "$SP" apply -p2 --include='sglang/srt/*' "$PATCH_DIR/$p"
    done
    echo "$VARIANT" > "$ENV/variant"
fi
(ROOT=$(pwd -P); cd / && "$ROOT/$ENV/bin/python" -W ignore - "$VERSION" "$ROOT" <<'PY'
import importlib.metadata as md, os, sys
import sglang, sglang.srt.plugins, sglang.srt.model_executor.model_runner  # noqa: F401 - must import
import sglang_patches
assert md.version("sglang") == sys.argv[1], md.version("sglang")
assert sglang.__file__.startswith(sys.prefix), sglang.__file__
here = os.path.realpath(sglang_patches.__file__)
assert here.startswith(os.path.join(sys.argv[2], "")), f"sglang_patches comes from {here}, not from {sys.argv[2]}"
PY
)
echo "$stamp" > "$ENV/.stamp"
echo "setup: $ENV ready"
