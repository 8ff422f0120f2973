"""Install / remove the CPU interpreter-start hook in a virtualenv's site-packages."""
import os
import sysconfig

PTH_NAME = "slime_moe_rollout_cpu.pth"
PTH_LINE = "import sglang_patches.cpu.site_hook as h; h.install()\n"


def pth_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def install() -> str:
    path = pth_path()
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def remove() -> None:
    if os.path.exists(pth_path()):
        os.remove(pth_path())
