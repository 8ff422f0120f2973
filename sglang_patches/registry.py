"""What a fix is, which SGLang variants are reviewed, and how a fix is judged before it applies.

A *variant* is an SGLang version plus the source fingerprints of marker functions that tell
trees of one version apart (stock 0.5.15.post1 vs the same wheel with slime's image patches,
which change `ModelRunner.forward`). The installed tree is matched against `VARIANTS`; no match
(unreviewed version, or an unknown edit to a marker) means no hook at all and one log line.

A fix module defines `FIX = Fix(...)` (or `FIXES`). Per variant a fix has a `Port`: hooks with
the reviewed fingerprint of every hooked target, or a hook-less state: `upstream` (SGLang fixed
it: guard test), `not-needed` (the defect is there but no supported configuration reaches it:
the reason and a test say why), `absent` (the defective code does not exist there). Verdict
states: active, upstream, not-needed, absent, idle (family not relevant to this process),
disabled (by env), refused (unreviewed variant, fingerprint mismatch, no port).

0.5.23's ports live in the fix modules themselves. Every other version has a package of its own
(`VERSION_PACKAGES`) whose `PORTS = {fix name: {variant name: Port}}` is merged into the fixes;
its hooks live in its submodules and reuse the fix module's shared logic.

Adding a variant (e.g. SGLang 0.5.16):
  1. `Variant("0.5.16", "0.5.16", markers={...})` in VARIANTS (markers: {} unless another
     reviewed variant shares the version; then fingerprints that differ between them).
  2. `sglang_patches/fixes/v0_5_16/__init__.py` with PORTS for every fix of FIX_MODULES
     (hooks in `v0_5_16/<fix>.py`), and "0.5.16": ("sglang_patches.fixes.v0_5_16",) in
     VERSION_PACKAGES. `tests/test_patch_registry.py` checks every fix has a port per variant.
  3. `requirements/sglang-0.5.16.txt` (the wheel + pins that differ): `scripts/setup_sglang_env.sh
     0.5.16` builds `.venvs/sglang-0.5.16`; add it to MATRIX_ENVS in the Makefile and the variant's
     scenarios (`tests/dp_scenarios_v0_5_16.py`, with EXPECT[variant]) to MATRIX in
     tests/test_version_matrix.py and tests/test_diffs.py.
  4. `sglang_patches/diffs/0.5.16/NNNN-<fix>.patch` (apply-source picks the set that fits a tree).
"""
import importlib
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

DISABLE_ENV = "SLIME_MOE_ROLLOUT_DISABLE"  # comma-separated fix names, or "all"
FIX_MODULES = (
    "sglang_patches.fixes.capturer_extent",
    "sglang_patches.fixes.routed_experts_rows",
    "sglang_patches.fixes.draft_extend_real_rows",
    "sglang_patches.fixes.verify_padding_lcm",
    "sglang_patches.fixes.upstream_guards",
    "sglang_patches.fixes.r3_guards",
    "sglang_patches.fixes.capture_snapshot",
    "sglang_patches.cpu.fixes",
    "sglang_patches.cpu.graphs",
)
MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


@dataclass(frozen=True)
class Variant:
    name: str  # "0.5.15.post1+slime"
    version: str  # what importlib.metadata reports: "0.5.15.post1"
    markers: dict = field(default_factory=dict)  # {target: fingerprint} this tree must have
    note: str = ""


VARIANTS = (
    Variant("0.5.23", "0.5.23", note="PyPI wheel"),
    Variant("0.5.15.post1", "0.5.15.post1", {MODEL_RUNNER_FORWARD: "582a0e699291c217"},
            note="PyPI wheel, stock"),
    Variant("0.5.15.post1+slime", "0.5.15.post1", {MODEL_RUNNER_FORWARD: "b30d0a53bc76792b"},
            note="slime's image: the wheel + slime's docker/patch/latest/sglang*.patch"),
    Variant("0.5.16", "0.5.16", note="PyPI wheel, stock (Miles)"),
)
VERSION_PACKAGES = {
    "0.5.15.post1": ("sglang_patches.fixes.v0_5_15", "sglang_patches.cpu.fixes.v0_5_15"),
    "0.5.16": ("sglang_patches.fixes.v0_5_16", "sglang_patches.cpu.fixes.v0_5_16"),
}
HOOKLESS_STATES = ("upstream", "not-needed", "absent")


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path, e.g. "sglang.srt.layers.dp_attention.get_dp_local_slice_cpu"
    fn: Callable
    kind: str = "around"  # before / after / around / replace (SGLang's HookType)


@dataclass(frozen=True)
class Port:
    """A fix on one variant: hooks pinned by fingerprints, or a hook-less state with its reason."""

    hooks: tuple = ()
    fingerprints: dict = field(default_factory=dict)  # {target: digest}
    state: str = "hooks"  # or one of HOOKLESS_STATES
    reason: str = ""
    test: str = ""  # the regression / guard test on this variant (default: the fix's test)

    def __post_init__(self):
        if self.state == "hooks":
            missing = {h.target for h in self.hooks} - set(self.fingerprints)
            assert self.hooks and not missing, f"hooks without a reviewed fingerprint: {missing}"
        else:
            assert self.state in HOOKLESS_STATES and self.reason and not self.hooks, self


@dataclass(frozen=True)
class Fix:
    name: str
    family: str  # "dp-attention" or "cpu"
    defect: str  # two sentences
    reference: str  # seed / upstream thread / fix-map section
    test: str  # regression (or guard) test node id
    ports: dict = field(default_factory=dict)  # variant name -> Port
    needed: Optional[Callable[[dict], bool]] = None  # does a server-args dict trigger it?
    when: Optional[Callable[[], Optional[str]]] = None  # returns a reason when idle here
    # Shorthand for the same hooks on several variants: {variant: {target: digest}} -> ports.
    hooks: tuple = ()
    fingerprints: dict = field(default_factory=dict)
    versions: tuple = ()  # legacy spelling of fingerprints' keys; checked, not used

    def __post_init__(self):
        assert set(self.versions) <= set(self.fingerprints), (self.name, self.versions)
        if self.fingerprints:
            ports = {v: Port(hooks=self.hooks, fingerprints=pins) for v, pins in self.fingerprints.items()}
            object.__setattr__(self, "ports", {**ports, **self.ports})

    @property
    def upstream(self) -> bool:
        """True when no reviewed variant needs hooks for it (a guard-only fix)."""
        return all(p.state != "hooks" for p in self.ports.values())


def _with_version_ports(fixes: list) -> list:
    extra = {}
    for packages in VERSION_PACKAGES.values():
        for name in packages:
            for fix_name, ports in importlib.import_module(name).PORTS.items():
                extra.setdefault(fix_name, {}).update(ports)
    known = {f.name for f in fixes}
    assert set(extra) <= known, f"ports for unknown fixes: {set(extra) - known}"
    return [replace(f, ports={**f.ports, **extra.get(f.name, {})}, fingerprints={}, versions=())
            if f.name in extra else f for f in fixes]


def all_fixes() -> list:
    fixes = []
    for mod_name in FIX_MODULES:
        mod = importlib.import_module(mod_name)
        fixes.extend(mod.FIXES if hasattr(mod, "FIXES") else [mod.FIX])
    return _with_version_ports(fixes)


def sglang_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def disabled_names() -> set:
    return {x.strip() for x in os.environ.get(DISABLE_ENV, "").split(",") if x.strip()}


@dataclass(frozen=True)
class Detection:
    version: Optional[str]
    variant: Optional[Variant]
    refusal: Optional[str] = None  # why no variant matched: no hook at all


def _safe(fingerprint_fn, target):
    from sglang_patches.fingerprint import TargetNotFound

    try:
        return fingerprint_fn(target)
    except TargetNotFound as e:
        return f"missing ({e})"


def detect(ver: Optional[str] = None, fingerprint_fn=None) -> Detection:
    """Which reviewed variant the installed SGLang (version `ver`, default: installed) is."""
    from sglang_patches.fingerprint import fingerprint

    fingerprint_fn = fingerprint_fn or fingerprint
    ver = sglang_version() if ver is None else ver
    if ver is None:
        return Detection(None, None, "SGLang is not installed")
    candidates = [v for v in VARIANTS if v.version == ver]
    if not candidates:
        reviewed = ", ".join(v.name for v in VARIANTS)
        return Detection(ver, None, f"SGLang {ver} is not a reviewed version (reviewed: {reviewed})")
    seen = {}
    for v in candidates:
        got = {t: seen.setdefault(t, _safe(fingerprint_fn, t)) for t in v.markers}
        if got == v.markers:
            return Detection(ver, v)
    edits = ", ".join(f"{t.rsplit('.', 2)[-2]}.{t.rsplit('.', 1)[-1]} {d}" for t, d in sorted(seen.items()))
    names = ", ".join(v.name for v in candidates)
    return Detection(ver, None, f"SGLang {ver} with an unknown edit: markers {edits} match no reviewed "
                                f"variant ({names})")


@dataclass
class Verdict:
    fix: Fix
    state: str
    reason: str = ""


def judge(fix: Fix, where, fingerprint_fn=None) -> Verdict:
    """One fix's state on `where`: a Detection, or an SGLang version string detected here."""
    from sglang_patches.fingerprint import TargetNotFound, fingerprint

    fingerprint_fn = fingerprint_fn or fingerprint
    d = where if isinstance(where, Detection) else detect(where, fingerprint_fn)
    if d.refusal:
        return Verdict(fix, "refused", d.refusal)
    port = fix.ports.get(d.variant.name)
    idle = fix.when() if fix.when is not None else None
    if port is None:
        return Verdict(fix, "idle", idle) if idle else Verdict(
            fix, "refused", f"not ported to SGLang {d.variant.name}")
    if port.state != "hooks":
        return Verdict(fix, port.state, f"{port.reason}; test {port.test or fix.test}")
    off = disabled_names()
    if fix.name in off or "all" in off:
        return Verdict(fix, "disabled", f"disabled by {DISABLE_ENV}")
    if idle:
        return Verdict(fix, "idle", idle)
    for hook in port.hooks:
        want = port.fingerprints[hook.target]
        try:
            got = fingerprint_fn(hook.target)
        except TargetNotFound as e:
            return Verdict(fix, "refused", f"hook target missing: {e}")
        if got != want:
            return Verdict(fix, "refused", f"source of {hook.target} changed (fingerprint {got} != reviewed {want})")
    return Verdict(fix, "active", f"{len(port.hooks)} hook(s)")
