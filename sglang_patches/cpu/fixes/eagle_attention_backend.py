"""CPU: EAGLE needs the intel_amx attention backend, which is refused on CPUs without AMX.

On CPU, only `intel_amx` has EAGLE draft-decode / draft-extend / target-verify support
(torch_native raises "EAGLE is not supported in decode attention backend torch_native"), but
`_attention_backend_platform_fallbacks` rewrites `intel_amx` to `torch_native` whenever the
platform lacks AMX. The backend's attention ops (`decode/extend_attention_cpu`) need no AMX
when they come from our torch `sgl_kernel` substitute.

Fix: AROUND that pass: keep `intel_amx` on CPU when speculative decoding is configured and the
loaded `sgl_kernel` is our CPU substitute; otherwise SGLang decides (plain runs keep falling
back to torch_native, which is faster than the substitute's per-request attention). Linear/MoE layers keep their own (module-level) AMX
checks, so they stay on the torch paths.
"""
import logging

from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.arg_groups.overrides._attention_backend_platform_fallbacks"
logger = logging.getLogger("slime_moe_rollout")


def substitute_has_attention() -> bool:
    try:
        import sgl_kernel
    except ImportError:
        return False
    return bool(getattr(sgl_kernel, "IS_CPU_SUBSTITUTE", False))


def keep_intel_amx(original, view, *args, **kwargs):
    if (
        view.attention_backend == "intel_amx"
        and view.device == "cpu"
        and getattr(view, "speculative_algorithm", None)
        and substitute_has_attention()
    ):
        logger.warning("slime-moe-rollout: keeping attention backend intel_amx on a CPU without AMX "
                       "(attention ops come from the torch sgl_kernel substitute)")
        return {}
    return original(view, *args, **kwargs)


KEEP_AMX = Hook(TARGET, keep_intel_amx, "around")

FIX = Fix(
    name="cpu-eagle-attn-backend",
    family="cpu",
    defect=(
        "On CPU only the intel_amx attention backend supports EAGLE/NEXTN, but SGLang rewrites it to "
        "torch_native on CPUs without AMX. Speculative decoding then refuses to start."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-eagle-attn-backend]",
    when=cpu_idle_reason,
)
