"""`make image-check`: docker/Dockerfile built for real (buildah) on local bases that mirror slime's image.

e2e: it builds three images (Debian bookworm, torch, SGLang) and starts an engine inside one. It needs
root, buildah and debootstrap (installed with apt when missing), a Debian mirror and PyPI. The script
takes the engine lock itself for its engine step only (ENGINE_LOCK), so do not run this test under it."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = ["slime-like", "unreviewed (0.5.14)", "unreviewed, REQUIRE_FIXES=0", "engine in the image",
          "image-check total"]


@pytest.mark.e2e
@pytest.mark.timeout(7200)
def test_make_image_check():
    if os.geteuid() != 0:
        pytest.skip("image-check needs root (debootstrap, buildah chroot isolation)")
    r = subprocess.run(["make", "-s", "image-check"], cwd=ROOT, capture_output=True, text=True, timeout=7000)
    out = r.stdout + r.stderr
    for name in CHECKS:
        assert re.search(rf"^PASS {re.escape(name)}", out, re.M), out[-4000:]
    if os.environ.get("SLIME_SRC"):
        assert "variant 0.5.15.post1+slime" in out, out[-4000:]
    assert re.search(r"^PASS unreviewed \(0\.5\.14\) .*failed at the fix check: "
                     r"SGLang 0\.5\.14 is not a reviewed version; error: fixes not active: ", out, re.M), out[-4000:]
    assert r.returncode == 0, out[-4000:]
