"""docker/image_check.sh's own judgement, with buildah and debootstrap replaced by stubs (named so: the real
build is test_docker_image.py, e2e and root only). A copy of docker/ and requirements/ runs in a temporary
folder, so nothing lands in the checkout.

- "unreviewed (0.5.14)" passes only on the expected reason (0.5.14 is not reviewed, the fix check refuses it),
  never on any failed build;
- a folder the user chose as IMAGE_STORE keeps what it held: the cleanup removes only what the run added."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in for buildah: images "exist" (the local bases are reused), `bud` writes the log line that
# $BUD_LOG_<tag> names and fails; `from` fails (no engine step).
BUILDAH = r"""#!/usr/bin/env bash
case "$1" in
  inspect|tag|rm|rmi) exit 0 ;;
  from) echo "stub buildah: no images" >&2; exit 1 ;;
  bud) tag=""; while [ $# -gt 0 ]; do [ "$1" = -t ] && tag=${2##*:}; shift; done
       var="BUD_LOG_${tag//-/_}"; printf '%b\n' "${!var:-error: stub build of $tag}"; exit 1 ;;
esac
exit 0
"""
REFUSED = ("+ python -m rollout.cli patches status\\nSGLang 0.5.14 (variant no reviewed variant: SGLang 0.5.14 is "
           "not a reviewed version (reviewed: 0.5.15.post1, 0.5.23))\\nerror: fixes not active: 0.5.14 is unreviewed")
OTHER = ("+ python -m rollout.cli patches status\\nerror: pip could not resolve sglang==0.5.14")


def _run(tmp_path, unreviewed_log, store):
    work = tmp_path / "repo"
    for d in ("docker", "requirements"):
        shutil.copytree(os.path.join(ROOT, d), work / d)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "buildah").write_text(BUILDAH)
    (stubs / "debootstrap").write_text("#!/bin/sh\nexit 1\n")
    for s in stubs.iterdir():
        s.chmod(0o755)
    (store / "wheelhouse").mkdir(parents=True, exist_ok=True)
    (store / "wheelhouse" / "torch-2.13.0+cpu-cp311-linux_x86_64.whl").write_text("")
    (store / "rootfs.tar").write_text("")
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "IMAGE_STORE": str(store),
           "BUD_LOG_unreviewed": unreviewed_log, "ENGINE_LOCK": ""}
    env.pop("SLIME_SRC", None)
    p = subprocess.run(["bash", str(work / "docker" / "image_check.sh")], capture_output=True, text=True,
                       env=env, timeout=120)
    return p.stdout + p.stderr


@pytest.mark.timeout(180)
def test_unreviewed_passes_only_on_the_expected_reason(tmp_path):
    out = _run(tmp_path, REFUSED, tmp_path / "store1")
    assert re.search(r"^PASS unreviewed \(0\.5\.14\) .*SGLang 0\.5\.14 is not a reviewed version; error: fixes not "
                     r"active", out, re.M), out
    out = _run(tmp_path / "b", OTHER, tmp_path / "store2")
    assert re.search(r"^FAIL unreviewed \(0\.5\.14\) .*build failed at the fix check: error: pip could not", out,
                     re.M), out


@pytest.mark.timeout(180)
def test_a_chosen_store_keeps_what_it_held(tmp_path):
    store = tmp_path / "my-folder"
    store.mkdir()
    (store / "precious.txt").write_text("mine")
    out = _run(tmp_path, REFUSED, store)
    assert "image-check: storage removed" in out, out
    assert store.is_dir() and (store / "precious.txt").read_text() == "mine", out
    assert sorted(os.listdir(store)) == ["precious.txt", "rootfs.tar", "wheelhouse"], os.listdir(store)
