"""The CPU fix family on stock SGLang 0.5.15.post1 (issue 9 item 6: the embedded CPU engine there).

Same hooks as on 0.5.23: the hooked functions differ only in code these hooks do not depend on
(0.5.15's `_cuda_host_register` has no chunking, its AMX check is `cpu_has_amx_support()`, its
`all_gather_into_tensor` has no CPU branch, its `moe_forward_native` no `situ` activation).
0.5.15's routed-experts `BaseHostCache` allocates with `torch.zeros(pin_memory=True)` itself (not
through `_cuda_host_register`), which a CPU-only torch refuses at start-up ("pin_memory=True requires
a CUDA or other accelerator backend"): cpu-host-register there also wraps `BaseHostCache.__init__`.
`cpu-thread-binding` is not ported: 0.5.15 binds in `ModelRunner.init_threads_binding(self)` and the
engine launcher sets SGLANG_CPU_OMP_THREADS_BIND for multi-rank engines itself.
"""
import importlib

from sglang_patches.registry import Hook, Port

V = "0.5.15.post1"
PINS = {  # fix module -> {target: 0.5.15.post1 fingerprint}
    "host_register": ("408f1eed3b00a7e6",),
    "cuda_synchronize": ("3438d8ef569c0d5f",),
    "eagle_attention_backend": ("984563e2d6265ce6",),
    "torch_native_fill": ("681e6d1c8d8ac744",),
    "ep_native_moe": ("4fd0e5b793d2d0ac",),
    "gloo_varsize_collectives": ("05109e16dab0bdb4", "9d85ae1727638521"),
    "gloo_stacked_allgather": ("bdef29a7aa66691f",),
}


HOST_CACHE_INIT = "sglang.srt.state_capturer.base.BaseHostCache.__init__"


def _unpinned_mode():
    """A torch-function mode (thread-local, scoped by `with`): factory calls drop pin_memory=True."""
    from torch.overrides import TorchFunctionMode

    class Unpinned(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            kwargs.pop("pin_memory", None)  # nothing to pin without CUDA: plain host memory
            return func(*args, **kwargs)

    return Unpinned()


def unpinned_host_cache(original, *args, **kwargs):
    """AROUND BaseHostCache.__init__ on a CPU engine: its own torch.zeros(pin_memory=True) gets host memory.
    The mode covers this call on this thread only; module globals and other threads are untouched."""
    import torch

    if torch.cuda.is_available():
        return original(*args, **kwargs)
    with _unpinned_mode():
        return original(*args, **kwargs)


def _port(module: str, digests: tuple, extra: tuple = (), extra_pins: dict = None, version: str = V,
          test: str = None) -> tuple:
    """fix name, {version: 0.5.23's hooks (+ extra) pinned to `digests` (+ extra_pins)}."""
    fix = importlib.import_module(f"sglang_patches.cpu.fixes.{module}").FIX
    hooks = fix.ports["0.5.23"].hooks
    pins = dict(zip((h.target for h in hooks), digests), **(extra_pins or {}))
    return fix.name, {version: Port(hooks=hooks + extra, fingerprints=pins, test=test or TEST)}


TEST = "tests/test_engine_v0_5_15.py::test_a_routed_experts_match_transformers[0.5.15.post1]"
HOST_CACHE_PIN = {HOST_CACHE_INIT: "24c16491a52570c3"}


def ports(version: str, test: str) -> dict:
    """PINS' ports on `version` (same targets and sources as 0.5.15.post1), cpu-host-register with its
    BaseHostCache hook."""
    out = dict(_port(m, d, version=version, test=test) for m, d in PINS.items() if m != "host_register")
    out.update([_port("host_register", PINS["host_register"], (Hook(HOST_CACHE_INIT, unpinned_host_cache),),
                      HOST_CACHE_PIN, version, test)])
    return out


PORTS = ports(V, TEST)
