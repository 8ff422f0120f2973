#!/usr/bin/env bash
# `make image-check`: build docker/Dockerfile for real with buildah on local bases that mirror slime's
# image (docker/local_base.sh), and judge what the build and the image do. One line per check and the
# time taken; exit 1 if any check fails. Needs root (debootstrap, buildah's chroot isolation), network
# access to a Debian mirror and PyPI, and about 25 GB free under $IMAGE_STORE; installs buildah and
# debootstrap with apt when missing. Everything it stores is removed at the end (IMAGE_CHECK_KEEP=1 keeps it).
#
#   SLIME_SRC=<slime checkout> docker/image_check.sh
#
# Checks:
#   slime-like   base 0.5.15.post1 + slime's docker/patch/latest patches (stock 0.5.15.post1 without
#                SLIME_SRC): the build passes and `slime-moe-rollout patches status` in the image shows
#                that variant with every fix good.
#   unreviewed   base SGLang 0.5.14: the build fails at the fix check with its one-line reason ...
#   unreviewed, REQUIRE_FIXES=0   ... and passes with REQUIRE_FIXES=0.
#   engine       in the slime-like image (buildah run, loopback): the demo config's first engine
#                (training_configs/tiny-cpu.yaml) answers a request with routed experts and logs the
#                plugin's active fixes. The CPU enablement (the project's CPU interpreter hook, and g++ and
#                python3-dev from apt for torch's CPU code generation) is installed in that run's container
#                only: the image itself stays as the Dockerfile made it.
#                Runs under `flock $ENGINE_LOCK` (default /tmp/engine.lock; empty: no lock), so that engine
#                tests on the same machine take turns.
#   stock        (IMAGE_CHECK_STOCK=1) base SGLang 0.5.23: the build passes with every fix good.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  echo "image-check: installing buildah and debootstrap (apt)"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah debootstrap; } > /tmp/image-check-apt.log 2>&1 \
    || { tail -3 /tmp/image-check-apt.log; echo "image-check: apt-get install buildah debootstrap failed"; exit 2; }
fi
# what $IMAGE_STORE held before (a folder the user chose may hold other things): the cleanup removes only the rest
STORE_NEW=1; STORE_WAS=()
if [ -d "${IMAGE_STORE:-.cache/image-check}" ]; then STORE_NEW=0; mapfile -t STORE_WAS < <(ls -A "${IMAGE_STORE:-.cache/image-check}"); fi
source docker/local-base/buildah-env.sh
LOGS=$IMAGE_STORE/logs
mkdir -p "$LOGS"
FAILED=0
cleanup() {
  if [ "${IMAGE_CHECK_KEEP:-0}" = 1 ]; then
    echo "image-check: kept $IMAGE_STORE (logs in $LOGS)"
  else
    mkdir -p "$REPO/.cache" && rm -rf "$REPO/.cache/image-check-logs" && mv "$LOGS" "$REPO/.cache/image-check-logs"
    buildah rm --all >/dev/null 2>&1; buildah rmi --all --force >/dev/null 2>&1
    if [ "$STORE_NEW" = 1 ]; then
      rm -rf "$IMAGE_STORE"
    else  # never a folder this run did not create: only the entries it added
      ls -A "$IMAGE_STORE" | while read -r e; do
        printf '%s\n' "${STORE_WAS[@]}" | grep -qxF -- "$e" || rm -rf -- "${IMAGE_STORE:?}/$e"
      done
    fi
    echo "image-check: storage removed; logs in $REPO/.cache/image-check-logs"
  fi
}
trap cleanup EXIT
# judge NAME START OK DETAIL: one judged line
judge() {
  local verdict=PASS
  [ "$3" = 1 ] || { verdict=FAIL; FAILED=1; }
  printf '%-4s %-32s %5ss  %s\n' "$verdict" "$1" "$(( $(date +%s) - $2 ))" "$4"
}
last_error() { grep -E '^error: ' "$1" | tail -1; }
build() {  # build TAG BASE_TAG [ARGS...]: docker/Dockerfile on localhost/slime-local:BASE_TAG, log in $LOGS/TAG.log
  local tag=$1 base=$2; shift 2
  buildah bud --format docker --isolation chroot --pull=never --layers=false "${BUD_MOUNTS[@]}" -f docker/Dockerfile \
    --build-arg BASE_IMAGE=localhost/slime-local --build-arg BASE_TAG="$base" "$@" \
    -t "localhost/slime-moe-rollout:$tag" . > "$LOGS/$tag.log" 2>&1
}
status_json() {  # status_json IMAGE: `slime-moe-rollout patches status --json` inside the image
  local ctr rc
  ctr=$(buildah from --pull=never "$1") || return 1
  buildah run --isolation chroot "$ctr" -- slime-moe-rollout patches status --json; rc=$?
  buildah rm "$ctr" >/dev/null
  return $rc
}
# judge_status NAME START IMAGE WANT_VARIANT: the image's fix status is WANT_VARIANT with every fix good
judge_status() {
  local js detail
  js=$(status_json "$3" 2>"$LOGS/$1-status.err")
  detail=$(python3 -c '
import json, sys
r = json.loads(sys.argv[1]); want = sys.argv[2]
bad = [f["name"] + "=" + f["state"] for f in r["fixes"] if f["state"] not in ("active", "upstream", "not-needed", "absent", "idle")]
states = {}
for f in r["fixes"]:
    states[f["state"]] = states.get(f["state"], 0) + 1
ok = r["variant"] == want and r["ok"] and not bad
print(("1 " if ok else "0 ") + "sglang %s, variant %s, %s%s" % (r["sglang_version"], r["variant"],
      ", ".join("%d %s" % (n, s) for s, n in sorted(states.items())), "; not good: " + ", ".join(bad) if bad else ""))
' "$js" "$4" 2>&1) || detail="0 no status: $(tail -1 "$LOGS/$1-status.err")"
  judge "$1" "$2" "${detail%% *}" "${detail#* }"
}

SLIME_VARIANT=0.5.15.post1+slime
[ -n "${SLIME_SRC:-}" ] || { SLIME_VARIANT=0.5.15.post1; echo "image-check: SLIME_SRC not given: the slime-like base is stock 0.5.15.post1"; }
BASES=("$SLIME_VARIANT" 0.5.14)
[ "${IMAGE_CHECK_STOCK:-0}" = 1 ] && BASES+=(0.5.23)

t=$(date +%s)
bash docker/local_base.sh "${BASES[@]}" > "$LOGS/bases.log" 2>&1; rc=$?
judge "bases (${BASES[*]})" "$t" "$([ $rc = 0 ] && echo 1)" \
  "$([ $rc = 0 ] && echo "debootstrap bookworm, python3.11, torch 2.13.0+cpu, SGLang --no-deps + pins" || tail -1 "$LOGS/bases.log")"
[ $rc = 0 ] || exit 1

SLIME_TAG=${SLIME_VARIANT//+/-}
t=$(date +%s)
if build slime "$SLIME_TAG"; then
  judge_status "slime-like ($SLIME_VARIANT)" "$t" localhost/slime-moe-rollout:slime "$SLIME_VARIANT"
else
  judge "slime-like ($SLIME_VARIANT)" "$t" 0 "build failed: $(last_error "$LOGS/slime.log" || tail -1 "$LOGS/slime.log")"
fi

t=$(date +%s)
build unreviewed 0.5.14; rc=$?
reason=$(last_error "$LOGS/unreviewed.log")
at_check=$(grep -c -- '-m rollout.cli patches status' "$LOGS/unreviewed.log")
# the status header names why: "SGLang V (variant no reviewed variant: <why> (reviewed: ...))"
why=$(grep -m1 -oE 'variant no reviewed variant: [^(]*' "$LOGS/unreviewed.log" | sed 's/^variant no reviewed variant: //; s/ *$//')
# the expected reason: 0.5.14 is not reviewed and the fix check refuses it (any other failure is a FAIL)
want_why="SGLang 0.5.14 is not a reviewed version"
judge "unreviewed (0.5.14)" "$t" "$([ $rc != 0 ] && [ "$at_check" -gt 0 ] && [ "$why" = "$want_why" ] \
  && [[ "$reason" == "error: fixes not active: "* ]] && echo 1)" \
  "build $([ $rc = 0 ] && echo passed || echo failed) at the fix check: ${why:+$why; }$(cut -c1-60 <<< "${reason:-no error line}")..."
buildah rmi --force localhost/slime-moe-rollout:unreviewed >/dev/null 2>&1

t=$(date +%s)
build unreviewed-allowed 0.5.14 --build-arg REQUIRE_FIXES=0; rc=$?
judge "unreviewed, REQUIRE_FIXES=0" "$t" "$([ $rc = 0 ] && grep -q 'allowed by --allow-refused' "$LOGS/unreviewed-allowed.log" && echo 1)" \
  "build $([ $rc = 0 ] && echo passed || echo failed): $(grep -E 'install.sh: (fixes not active|done)' "$LOGS/unreviewed-allowed.log" | paste -sd' ')"
buildah rmi --force localhost/slime-moe-rollout:unreviewed-allowed >/dev/null 2>&1

if [ "${IMAGE_CHECK_STOCK:-0}" = 1 ]; then
  t=$(date +%s)
  if build stock 0.5.23; then
    judge_status "stock (0.5.23)" "$t" localhost/slime-moe-rollout:stock 0.5.23
  else
    judge "stock (0.5.23)" "$t" 0 "build failed: $(last_error "$LOGS/stock.log")"
  fi
  buildah rmi --force localhost/slime-moe-rollout:stock >/dev/null 2>&1
fi

t=$(date +%s)
if ctr=$(buildah from --pull=never localhost/slime-moe-rollout:slime 2>"$LOGS/engine.log"); then
  # In this container only: a C++ compiler and Python's headers (torch's CPU code generation compiles
  # kernels; the local base leaves them out, slime's image has them) and the CPU enablement; then the demo
  # config's first engine on loopback, one request.
  buildah run --isolation chroot "$ctr" -- bash -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends g++ python3-dev' >> "$LOGS/engine.log" 2>&1
  lock=(); [ -z "${ENGINE_LOCK-/tmp/engine.lock}" ] || lock=(flock "${ENGINE_LOCK-/tmp/engine.lock}")
  "${lock[@]}" timeout 900 buildah run --isolation chroot "$ctr" -- bash -c '
    set -e
    python3 -c "from sglang_patches.cpu import env; print(\"CPU hook:\", env.install())"
    slime-moe-rollout engine build-model --path /tmp/tiny-glm45
    slime-moe-rollout engine launch --config /opt/slime-moe-rollout/training_configs/tiny-cpu.yaml \
      --model-path /tmp/tiny-glm45 --log-dir /tmp/engine-logs --max-new-tokens 8
  ' >> "$LOGS/engine.log" 2>&1; rc=$?
  buildah rm "$ctr" >/dev/null 2>&1
else
  rc=1
fi
fixes=$(grep -m1 '^plugin: active fixes: ' "$LOGS/engine.log" | sed 's/^plugin: //')
routed=$(grep -m1 '^routed experts: [0-9]' "$LOGS/engine.log")
judge "engine in the image" "$t" "$([ $rc = 0 ] && [ -n "$fixes" ] && [ "$fixes" != "active fixes: none" ] && [ -n "$routed" ] && echo 1)" \
  "$( [ -n "$routed" ] && echo "$routed; $fixes" || { echo "rc $rc: "; grep -E '^(routed experts|plugin|error)' "$LOGS/engine.log" | tail -2 | paste -sd' '; } )"

judge "image-check total" "$T0" "$([ $FAILED = 0 ] && echo 1)" "$([ $FAILED = 0 ] && echo "every check passed" || echo "a check failed (see the logs)")"
exit $FAILED
