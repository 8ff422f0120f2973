"""Copied into the device's SITE by scripts/gpu_check/run.sh: every Python process started with
PYTHONPATH=SITE (engine, scheduler, detokenizer, checks) installs scripts/gpu_check/kernel_shim.py
(GPU_CHECK_SHIM names it; GPU_CHECK_KERNELS picks torch or jit kernels). A `sitecustomize` of the
image further down sys.path still runs, after the shim."""
import importlib.util
import os
import sys

_shim = os.environ.get("GPU_CHECK_SHIM")
if _shim:
    _spec = importlib.util.spec_from_file_location("gpu_check_kernel_shim", _shim)
    _mod = sys.modules["gpu_check_kernel_shim"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.install(os.environ.get("GPU_CHECK_KERNELS", "torch"))

_here = os.path.dirname(os.path.abspath(__file__))
for _dir in sys.path:
    _other = os.path.join(_dir or ".", "sitecustomize.py")
    if os.path.abspath(_dir or ".") != _here and os.path.isfile(_other):
        _spec = importlib.util.spec_from_file_location("_image_sitecustomize", _other)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
