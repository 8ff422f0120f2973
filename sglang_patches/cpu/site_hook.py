"""Interpreter-start hook for CPU environments (installed as a `.pth` file).

Two import-time gaps of PyPI packages on a CPU-only torch are closed here:
- `sgl_kernel`: PyPI has only CUDA builds. If no real `sgl_kernel` is importable,
  `import sgl_kernel` gets our torch substitute (`sgl_kernel_cpu`). A real one always wins.
- torchvision: PyPI's build is CUDA-only; its fake-op registration needs
  `torchvision::nms` / `qnms` defined. We define them just before the first import,
  only when torch has no CUDA.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_SUBSTITUTE = os.path.join(os.path.dirname(__file__), "sgl_kernel_cpu", "__init__.py")
_TV_LIB = []


def _define_torchvision_ops() -> None:
    import torch

    if torch.version.cuda is not None or _TV_LIB:
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_LIB.append(lib)


class _CpuFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name not in ("sgl_kernel", "torchvision") or self._busy:
            return None
        self._busy = True
        try:
            if name == "torchvision":
                _define_torchvision_ops()
                return None
            if importlib.machinery.PathFinder.find_spec(name) is not None:
                return None  # a real sgl_kernel is installed: never shadow it
            return importlib.util.spec_from_file_location(
                "sgl_kernel", _SUBSTITUTE, submodule_search_locations=[os.path.dirname(_SUBSTITUTE)]
            )
        finally:
            self._busy = False


def install() -> None:
    if os.environ.get("SLIME_MOE_ROLLOUT_NO_CPU_HOOK") == "1":
        return
    if not any(isinstance(f, _CpuFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CpuFinder())
