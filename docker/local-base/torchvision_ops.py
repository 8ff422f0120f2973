"""Local base only: let PyPI's torchvision (a CUDA build) import on the CPU build of torch.

PyPI has no CPU build of torchvision 0.28.0 and the CPU index is not always reachable; the CUDA build's
native ops cannot load on CPU torch, and its fake-op registration then fails on `torchvision::nms`. Before
torchvision is first imported, this defines the two schemas it registers fakes for, unless something
(the project's CPU hook) already did. slime's image has a torchvision built for its torch and needs nothing
of this. Loaded by 00-local-base-torchvision.pth in site-packages.
"""
import importlib.abc
import sys

_LIB = []


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" and not _LIB:
            import torch

            if torch.version.cuda is None and not torch._C._jit_get_schemas_for_operator("torchvision::nms"):
                lib = torch.library.Library("torchvision", "DEF")
                lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _LIB.append(lib)
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
