# Sourced by docker/local_base.sh and docker/image_check.sh.
# Storage: every buildah call of theirs keeps its images, containers and build contexts under one folder,
# $IMAGE_STORE (default <repo>/.cache/image-check), with the vfs driver (no overlay or fuse needed);
# `buildah rm --all`, `buildah rmi --all` and `rm -rf` of that folder remove it all.
# Network: RUN steps reach PyPI through this machine's network; this machine's CA bundle
# ($BUILD_CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt) is mounted read-only over the image's
# during builds (`BUD_MOUNTS`), so a TLS-intercepting proxy trusted here is trusted there. Never committed.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
IMAGE_STORE=${IMAGE_STORE:-$REPO/.cache/image-check}
mkdir -p "$IMAGE_STORE"
IMAGE_STORE=$(cd "$IMAGE_STORE" && pwd)
cat > "$IMAGE_STORE/storage.conf" <<CONF
[storage]
driver = "vfs"
graphroot = "$IMAGE_STORE/storage"
runroot = "$IMAGE_STORE/run"
CONF
export IMAGE_STORE CONTAINERS_STORAGE_CONF="$IMAGE_STORE/storage.conf" BUILDAH_ISOLATION=chroot
BUILD_CA_BUNDLE=${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
BUD_MOUNTS=()
[ ! -f "$BUILD_CA_BUNDLE" ] || BUD_MOUNTS=(-v "$BUILD_CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
