"""Install / remove the CPU interpreter-start hook in a virtualenv's site-packages."""
import os
import sysconfig

PTH_NAME = "slime_moe_rollout_cpu.pth"
PTH_LINE = "import sglang_patches.cpu.site_hook as h; h.install()\n"


def pth_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def needs_cpu_hook(torch_mod=None) -> bool:
    """True when no usable CUDA device is present, whatever torch build is installed: a CPU wheel,
    or PyPI's CUDA build of torch on a machine without a GPU (or without a working driver)."""
    if torch_mod is None:
        import torch as torch_mod
    if torch_mod.version.cuda is None:
        return True
    try:
        return not torch_mod.cuda.is_available()
    except Exception:  # a CUDA build whose driver cannot be loaded
        return True


def install() -> str:
    path = pth_path()
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def remove() -> None:
    if os.path.exists(pth_path()):
        os.remove(pth_path())
