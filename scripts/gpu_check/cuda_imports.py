"""Import an engine's SGLang modules (0.5.15.post1) with torch CLAIMING a CUDA device (mocked: no
GPU here), and load the plugin: import-time gaps of the substitutes on SGLang's CUDA branches
(a missing `sgl_kernel` submodule, a flashinfer or cutlass import) show on CPU before any device time.

    python scripts/gpu_check/cuda_imports.py [MODULE ...]   -> one JSON object {"ok", "imported", "failed", "registered"}
Run with the device check's PYTHONPATH (<site with sitecustomize.py>:<repo>) and GPU_CHECK_SHIM set.
Nothing is run on a device: only module import (and the plugin's registration) is exercised.
"""
import importlib
import json
import sys
import traceback
from unittest import mock

MODULES = (
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.models.glm4_moe", "sglang.srt.models.glm4_moe_nextn", "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.moe.fused_moe_triton.layer", "sglang.srt.layers.sampler",
    "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner", "sglang.srt.state_capturer.routed_experts",
)


def run(modules=MODULES) -> dict:
    import torch
    import torchvision  # noqa: F401  (CPU torch: its ops are defined while torch still says CPU)

    out = {"imported": [], "failed": None, "registered": None}
    with mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.version, "cuda", "13.0"), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)), \
            mock.patch.object(torch.cuda, "device_count", lambda: 1), \
            mock.patch.object(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H200"):
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the first gap is the answer
                where = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)[-3:]]
                out["failed"] = f"{name}: {type(e).__name__}: {e} (at {', '.join(where)})"
                break
            out["imported"].append(name)
        if out["failed"] is None:
            from sglang.srt.plugins import load_plugins

            load_plugins()
            from sglang_patches import plugin

            out["registered"] = list(plugin._registered)
    out["ok"] = out["failed"] is None
    return out


if __name__ == "__main__":
    print(json.dumps(run(tuple(sys.argv[1:]) or MODULES)))
    sys.stdout.flush()
