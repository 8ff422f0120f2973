"""What a fix is, which SGLang versions are reviewed, and how a fix is judged before it applies.

A fix module defines `FIX = Fix(...)`. Its hooks are surgical wrappers registered through
SGLang's `HookRegistry`; each hooked target is pinned by a source fingerprint per reviewed
version. States: active (would apply / applied), upstream (SGLang already fixed it: guard
test only), refused (version not reviewed, fingerprint mismatch, plugin excluded), idle
(family not relevant to this process, e.g. CPU fixes on a GPU engine), disabled (by env).
"""
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

REVIEWED_VERSIONS = ("0.5.23",)
KNOWN_UNREVIEWED = {
    "0.5.15.post1": "slime's image pins SGLang 0.5.15.post1 (with slime's source patches), which "
    "slime-moe-rollout does not review yet; build on a base image carrying SGLang 0.5.23",
}
DISABLE_ENV = "SLIME_MOE_ROLLOUT_DISABLE"  # comma-separated fix names, or "all"
FIX_MODULES = (
    "sglang_patches.fixes.capturer_extent",
    "sglang_patches.fixes.routed_experts_rows",
    "sglang_patches.fixes.draft_extend_real_rows",
    "sglang_patches.fixes.verify_padding_lcm",
    "sglang_patches.fixes.upstream_guards",
    "sglang_patches.fixes.r3_guards",
    "sglang_patches.cpu.fixes",
)


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path, e.g. "sglang.srt.layers.dp_attention.get_dp_local_slice_cpu"
    fn: Callable
    kind: str = "around"  # before / after / around / replace (SGLang's HookType)


@dataclass(frozen=True)
class Fix:
    name: str
    family: str  # "dp-attention" or "cpu"
    defect: str  # two sentences
    reference: str  # seed / upstream thread / fix-map section
    versions: tuple  # SGLang versions the defect exists in
    test: str  # regression (or guard) test node id
    hooks: tuple = ()
    fingerprints: dict = field(default_factory=dict)  # version -> {target: digest}
    upstream: bool = False  # already fixed in SGLang: guard test, no hook
    needed: Optional[Callable[[dict], bool]] = None  # does a server-args dict trigger it?
    when: Optional[Callable[[], Optional[str]]] = None  # returns a reason when idle here


def all_fixes() -> list:
    fixes = []
    for mod_name in FIX_MODULES:
        mod = importlib.import_module(mod_name)
        fixes.extend(mod.FIXES if hasattr(mod, "FIXES") else [mod.FIX])
    return fixes


def sglang_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def disabled_names() -> set:
    return {x.strip() for x in os.environ.get(DISABLE_ENV, "").split(",") if x.strip()}


def version_refusal(ver: Optional[str]) -> Optional[str]:
    if ver is None:
        return "SGLang is not installed"
    if ver in REVIEWED_VERSIONS:
        return None
    why = KNOWN_UNREVIEWED.get(ver, "nobody reviewed the fixes against it")
    return f"SGLang {ver} is not a reviewed version (reviewed: {', '.join(REVIEWED_VERSIONS)}): {why}"


@dataclass
class Verdict:
    fix: Fix
    state: str
    reason: str = ""


def judge(fix: Fix, ver: Optional[str], fingerprint_fn=None) -> Verdict:
    """Decide one fix's state for SGLang version `ver`, checking fingerprints."""
    from sglang_patches.fingerprint import TargetNotFound, fingerprint

    fingerprint_fn = fingerprint_fn or fingerprint
    refusal = version_refusal(ver)
    if refusal:
        return Verdict(fix, "refused", refusal)
    if fix.upstream or ver not in fix.versions:
        return Verdict(fix, "upstream", f"SGLang {ver} already handles it; guard test {fix.test}")
    off = disabled_names()
    if fix.name in off or "all" in off:
        return Verdict(fix, "disabled", f"disabled by {DISABLE_ENV}")
    if fix.when is not None and (idle := fix.when()):
        return Verdict(fix, "idle", idle)
    pins = fix.fingerprints.get(ver, {})
    for hook in fix.hooks:
        want = pins.get(hook.target)
        if want is None:
            return Verdict(fix, "refused", f"no reviewed fingerprint for {hook.target} in {ver}")
        try:
            got = fingerprint_fn(hook.target)
        except TargetNotFound as e:
            return Verdict(fix, "refused", f"hook target missing: {e}")
        if got != want:
            return Verdict(fix, "refused", f"source of {hook.target} changed (fingerprint {got} != reviewed {want})")
    return Verdict(fix, "active", f"{len(fix.hooks)} hook(s)")
