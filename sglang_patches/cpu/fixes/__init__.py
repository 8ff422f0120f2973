"""CPU enablement fix family: genuine SGLang CPU defects, each a small named fix.

Active only when SGLang runs on CPU (`SGLANG_USE_CPU_ENGINE=1` and torch without CUDA).
Each module defines `FIX`; list it in CPU_FIX_MODULES.
"""
import importlib
import os

CPU_FIX_MODULES = (
    "host_register",
    "cuda_synchronize",
    "eagle_attention_backend",
    "torch_native_fill",
    "ep_native_moe",
    "gloo_varsize_collectives",
    "gloo_stacked_allgather",
    "thread_binding",
    "dp_controller_idle",
)


def cpu_idle_reason():
    """None when this process runs SGLang's CPU engine, else why CPU fixes stay idle."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return "applies only with SGLANG_USE_CPU_ENGINE=1"
    import torch

    if torch.cuda.is_available():
        return "CUDA is available: not a CPU engine"
    return None


FIXES = [importlib.import_module(f"{__name__}.{m}").FIX for m in CPU_FIX_MODULES]
