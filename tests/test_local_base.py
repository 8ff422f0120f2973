"""docker/local_base.sh picks slime's SGLang patches as slime's Dockerfile does (PATCH_VERSION): the release's
own folder docker/patch/v<VERSION>/ where slime's tree has one, docker/patch/latest otherwise, and says which.

The slime tree is slime's real docker/patch folder (git archive of the mirror) or, where the mirror is absent,
a temp tree of the same shape (v0.5.15.post1 with four sglang patches, latest with five). The build itself runs
against a stand-in `buildah` (named FAKE_BUILDAH below: buildah cannot run here) that records the build context's
patches; nothing is built.
"""
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "local_base.sh"
MIRROR = Path("/work/.mirror/THUDM+slime/repo")
V15 = ["sglang.patch", "sglang-top_p.patch", "sglang-release_hicache.patch", "sglang-pull_weights.patch"]
LATEST = V15 + ["sglang-deterministic.patch"]   # slime's Dockerfile order
FAKE_BUILDAH = """#!/bin/bash
# stand-in for buildah: `inspect` knows only the python stage; `bud` records the context's slime patches
case "$1" in
  inspect) [[ "$*" == *smr-python* ]] ;;
  tag) exit 0 ;;
  bud) ls "${@: -1}/slime-patches" > "$RECORD" ;;
  *) exit 1 ;;
esac
"""


@pytest.fixture
def slime_src(tmp_path):
    src = tmp_path / "slime"
    src.mkdir()
    if MIRROR.is_dir():
        tar = subprocess.run(["git", "-C", str(MIRROR), "archive", "HEAD", "docker/patch"], capture_output=True,
                             check=True, timeout=60).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True, timeout=60)
    else:
        for folder, names in (("v0.5.15.post1", V15 + ["megatron.patch"]), ("latest", LATEST + ["megatron.patch"])):
            (src / "docker" / "patch" / folder).mkdir(parents=True)
            for n in names:
                (src / "docker" / "patch" / folder / n).write_text("diff\n")
    return src


def _build(tmp_path, slime_src, variant):
    """The real script, step 3 for `variant`, with the stand-in buildah: (rc, stderr, recorded patches)."""
    bin_dir, store = tmp_path / "bin", tmp_path / "store"
    bin_dir.mkdir(exist_ok=True)
    for tool, text in (("buildah", FAKE_BUILDAH), ("debootstrap", "#!/bin/sh\nexit 1\n")):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    (store / "wheelhouse").mkdir(parents=True, exist_ok=True)
    (store / "rootfs.tar").write_bytes(b"")
    (store / "wheelhouse" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    record = tmp_path / "record"
    record.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "IMAGE_STORE": str(store),
           "SLIME_SRC": str(slime_src), "RECORD": str(record)}
    r = subprocess.run(["bash", str(SCRIPT), variant], env=env, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stderr, sorted(record.read_text().split()) if record.exists() else None


def test_slime_release_folder_is_used_where_slime_has_one(tmp_path, slime_src):
    rc, err, patches = _build(tmp_path, slime_src, "0.5.15.post1+slime")
    assert rc == 0, err
    assert patches == sorted(V15), f"the build context holds {patches}, not slime's docker/patch/v0.5.15.post1"
    assert "slime's patches from docker/patch/v0.5.15.post1: " in err, err


def test_latest_where_slime_has_no_release_folder(tmp_path, slime_src):
    rc, err, patches = _build(tmp_path, slime_src, "0.5.23+slime")
    assert rc == 0, err
    assert patches == sorted(LATEST) and "slime's patches from docker/patch/latest: " in err, err


def test_selection_alone_prints_the_folder_and_the_patches_in_order(slime_src):
    def pick(version, src=slime_src):
        return subprocess.run(["bash", str(SCRIPT), "--slime-patches", version], capture_output=True, text=True,
                              timeout=30, env={**os.environ, "SLIME_SRC": str(src)})

    r = pick("0.5.15.post1")
    lines = r.stdout.split()
    assert r.returncode == 0 and lines[0] == "v0.5.15.post1", (r.stdout, r.stderr)
    assert [Path(p).name for p in lines[1:]] == V15 and all(Path(p).is_file() for p in lines[1:])
    r = pick("0.5.99")
    assert r.returncode == 0 and r.stdout.split()[0] == "latest"
    assert [Path(p).name for p in r.stdout.split()[1:]] == LATEST
    r = pick("0.5.15.post1", src=slime_src / "nowhere")
    assert r.returncode == 2 and "docker/patch has neither v0.5.15.post1 nor latest" in r.stderr, r.stderr
