"""What a fix is, which SGLang variants are reviewed, and how a fix is judged before it applies.

A *variant* is an SGLang version (plus, where two reviewed trees share a version, the fingerprints
of marker functions that tell them apart: stock 0.5.15.post1 vs the same wheel with slime's image
patches, which change `ModelRunner.forward`). The installed tree is matched against `VARIANTS`; no
match (unreviewed version, or an unknown edit to a marker) means no hook at all and one log line.

A fix module defines `FIX` (or `FIXES`) and its hooks, each `Hook` naming its target once. What a
fix does on a variant is data: the variant's port table `sglang_patches/ports/<table>.py` holds
`PORTS = {fix name: entry}`, one line per fix of every family (opt-in features too), in 0.5.23's order.
An entry is a `Port`, `same_as("<table>")` (that table's own Port: the hooked source is identical there;
no reference to a reference) or `NOT_PORTED`; `table` resolves them, a bad reference is a one-line error. A `Port` pins hooks to the reviewed fingerprint of their targets, or is hook-less:
upstream (SGLang fixed it: guard test), not-needed (the defect is there but no supported configuration
reaches it: the reason and a test say why), absent (the defective code does not exist there). A fix
not ported is idle where its family is idle, and refused otherwise.

Adding a variant (e.g. SGLang 0.5.24):
  1. `requirements/sglang-0.5.24.txt` (the wheel + the pins that differ from .venv), then
     `slime-moe-rollout patches review 0.5.24`: it builds `.venvs/sglang-0.5.24`, compares every
     hooked target's fingerprint with each table, runs the scenario list stock and with the nearest
     table's hooks, and prints a draft verdict per fix.
  2. `sglang_patches/ports/v0_5_24.py`: every fix by name; `same_as` for the Ports whose pins match;
     re-pin moved targets after reading their new source (a new hook in the fix module only where the
     code moved).
  3. `Variant("0.5.24", "0.5.24", "v0_5_24")` in VARIANTS; a driver in sglang_patches/scenarios/drivers.py
     only if a scenario's API differs; needles that differ in EXPECT_VARIANT (sglang_patches/scenarios/dp.py);
     the version in MATRIX_ENVS (Makefile).
  4. `sglang_patches/diffs/0.5.24/NNNN-<fix>.patch`, one per hooked fix.
  `make test` checks the rest (tests/test_patch_registry.py, test_version_matrix.py, test_diffs.py):
  a port per fix and variant, requirements, MATRIX_ENVS and diffs per variant, pins equal to the
  installed source, every hooked fix's scenarios failing stock with their needle and passing with
  the plugin, `patches status` all good.
"""
import importlib
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional

from sglang_patches.states import FixState

DISABLE_ENV = "SLIME_MOE_ROLLOUT_DISABLE"  # comma-separated fix names, or "all"
# Release review only (`patches review`): judge this unreviewed tree as the named variant.
REVIEW_AS_ENV = "SLIME_MOE_ROLLOUT_REVIEW_AS"
FIX_MODULES = (
    "sglang_patches.fixes.capturer_extent",
    "sglang_patches.fixes.routed_experts_rows",
    "sglang_patches.fixes.draft_extend_real_rows",
    "sglang_patches.fixes.verify_padding_lcm",
    "sglang_patches.fixes.upstream_guards",
    "sglang_patches.fixes.r3_guards",
    "sglang_patches.fixes.capture_snapshot",
    "sglang_patches.fixes.draft_token_count",
    "sglang_patches.fixes.accepted_path_rows",
    "sglang_patches.fixes.retraction_rows",
    "sglang_patches.fixes.retraction_routes",
    "sglang_patches.fixes.weight_update_pause",
    "sglang_patches.fixes.tokenizer_workers",
    "sglang_patches.cpu.fixes",
    "sglang_patches.cpu.graphs",
    "sglang_patches.features.routed_experts_wire",
)
MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
HOOKLESS_STATES = (FixState.UPSTREAM, FixState.NOT_NEEDED, FixState.ABSENT)


@dataclass(frozen=True)
class Variant:
    name: str  # "0.5.15.post1+slime"
    version: str  # what importlib.metadata reports: "0.5.15.post1"
    table: str  # port table module in sglang_patches/ports/
    markers: dict = field(default_factory=dict)  # {target: fingerprint} this tree must have
    note: str = ""


VARIANTS = (
    Variant("0.5.23", "0.5.23", "v0_5_23", note="PyPI wheel"),
    Variant("0.5.15.post1", "0.5.15.post1", "v0_5_15", {MODEL_RUNNER_FORWARD: "582a0e699291c217"},
            note="PyPI wheel, stock"),
    Variant("0.5.15.post1+slime", "0.5.15.post1", "v0_5_15", {MODEL_RUNNER_FORWARD: "b30d0a53bc76792b"},
            note="slime's image: the wheel + slime's docker/patch/latest/sglang*.patch"),
    Variant("0.5.16", "0.5.16", "v0_5_16", note="PyPI wheel, stock (Miles before v0.5.18)"),
    Variant("0.5.17", "0.5.17", "v0_5_17", note="PyPI wheel, stock (slime's next image)"),
    Variant("0.5.18", "0.5.18", "v0_5_18", note="PyPI wheel, stock (Miles' v0.5.18)"),
    Variant("0.5.19", "0.5.19", "v0_5_19", note="PyPI wheel, stock (Miles)"),
    Variant("0.5.20", "0.5.20", "v0_5_20", note="PyPI wheel, stock"),
    Variant("0.5.21", "0.5.21", "v0_5_21", note="PyPI wheel, stock"),
    Variant("0.5.22", "0.5.22", "v0_5_22", note="PyPI wheel, stock"),
)


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path, e.g. "sglang.srt.layers.dp_attention.get_dp_local_slice_cpu"
    fn: Callable
    kind: str = "around"  # before / after / around / replace (SGLang's HookType)


@dataclass(frozen=True)
class Port:
    """A fix on one variant: {Hook: reviewed fingerprint of its target}, or a hook-less state with its reason."""

    pins: dict = field(default_factory=dict)
    state: FixState = FixState.ACTIVE  # ACTIVE: the pinned hooks; else one of HOOKLESS_STATES
    reason: str = ""
    test: str = ""  # the regression / guard test on this variant (default: the fix's test)

    def __post_init__(self):
        assert self.state in tuple(FixState), f"unknown state {self.state!r}"
        object.__setattr__(self, "state", FixState(self.state))
        if self.state is FixState.ACTIVE:
            assert self.pins and all(isinstance(h, Hook) and d for h, d in self.pins.items()), self
        else:
            assert self.state in HOOKLESS_STATES and self.reason and not self.pins, self

    @property
    def hooks(self) -> tuple:
        return tuple(self.pins)

    @property
    def fingerprints(self) -> dict:
        return {h.target: d for h, d in self.pins.items()}


@dataclass(frozen=True)
class SameAs:
    """A table entry that is another table's Port for the same fix (the hooked source is identical there)."""

    table: str  # a port table module, e.g. "v0_5_23"


def same_as(table_name: str) -> SameAs:
    return SameAs(table_name)


NOT_PORTED = "not ported"  # a table entry: no Port on this variant (idle where its family is, else refused)


class PortTableError(ValueError):
    """A port table entry that does not resolve to a Port: one line naming the table and the fix."""


def _entries(name: str) -> dict:
    try:
        return importlib.import_module(f"sglang_patches.ports.{name}").PORTS
    except ModuleNotFoundError as e:
        if e.name != f"sglang_patches.ports.{name}":
            raise
        raise PortTableError(f"no port table {name}") from None


@lru_cache(maxsize=None)
def table(name: str) -> dict:
    """The port table `sglang_patches/ports/<name>.py` resolved: {fix name: Port}, without the fixes not
    ported. A `same_as` must name a table whose own entry for that fix is a Port."""
    ports = {}
    for fix, entry in _entries(name).items():
        if isinstance(entry, SameAs):
            where = f"ports/{name}.py: {fix} is same_as({entry.table!r})"
            try:
                target = _entries(entry.table).get(fix, NOT_PORTED)
            except PortTableError:
                raise PortTableError(f"{where}: no such table") from None
            if isinstance(target, SameAs):
                raise PortTableError(f"{where}, which is itself same_as({target.table!r})")
            if not isinstance(target, Port):
                raise PortTableError(f"{where}, which does not port it")
            entry = target
        if isinstance(entry, Port):
            ports[fix] = entry
        elif entry != NOT_PORTED:
            raise PortTableError(f"ports/{name}.py: {fix} is {entry!r}, not a Port, same_as or NOT_PORTED")
    return ports


@dataclass(frozen=True)
class Fix:
    name: str
    family: str  # "dp-attention", "r3" (routed-expert rows outside DP), "cpu" or "feature" (opt-in, not a fix)
    defect: str  # two sentences (a feature: what it does)
    reference: str  # upstream thread, or where the defect was found
    test: str  # regression (or guard) test node id
    needed: Optional[Callable[[dict], bool]] = None  # does a server-args dict trigger it?
    when: Optional[Callable[[], Optional[str]]] = None  # returns a reason when idle here

    @property
    def ports(self) -> dict:
        """{variant name: Port} from the port tables."""
        return {v.name: table(v.table)[self.name] for v in VARIANTS if self.name in table(v.table)}


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


@dataclass(frozen=True)
class Detection:
    version: Optional[str]
    variant: Optional[Variant]
    refusal: Optional[str] = None  # why no variant matched: no hook at all
    review: bool = False  # an unreviewed tree judged as `variant` by REVIEW_AS_ENV


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
    review_as = os.environ.get(REVIEW_AS_ENV)
    if review_as:
        v = next((v for v in VARIANTS if v.name == review_as), None)
        if v is None:
            return Detection(ver, None, f"{REVIEW_AS_ENV}={review_as} is not a reviewed variant")
        return Detection(ver, v, review=True)
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


@dataclass(frozen=True)
class Verdict:
    """One fix's state here, and (asked about a configuration) whether that configuration reaches it."""

    fix: Fix
    state: FixState
    reason: str = ""
    needed: Optional[bool] = None  # None: no configuration asked about

    @property
    def satisfied(self) -> bool:
        """Nothing left for the user to do about this fix: a good state, or a configuration that does not need it."""
        return self.state.good or self.needed is False

    def as_dict(self) -> dict:
        d = {"name": self.fix.name, "family": self.fix.family, "state": self.state.value, "reason": self.reason,
             "test": self.fix.test, "reference": self.fix.reference}
        if self.needed is not None:
            d["needed"] = self.needed
        return d


def judge(fix: Fix, where, fingerprint_fn=None) -> Verdict:
    """One fix's state on `where`: a Detection, or an SGLang version string detected here."""
    d = where if isinstance(where, Detection) else detect(where, fingerprint_fn)
    if d.refusal:
        return Verdict(fix, FixState.REFUSED, d.refusal)
    port = table(d.variant.table).get(fix.name)
    idle = fix.when() if fix.when is not None else None
    if port is None:
        return Verdict(fix, FixState.IDLE, idle) if idle else Verdict(
            fix, FixState.REFUSED, f"not ported to SGLang {d.variant.name}")
    if port.state is not FixState.ACTIVE:
        return Verdict(fix, port.state, f"{port.reason}; test {port.test or fix.test}")
    off = disabled_names()
    if fix.name in off or "all" in off:
        return Verdict(fix, FixState.DISABLED, f"disabled by {DISABLE_ENV}")
    if idle:
        return Verdict(fix, FixState.IDLE, idle)
    problem = pin_problem(port.pins, fingerprint_fn, review=d.review)
    if problem:
        return Verdict(fix, FixState.REFUSED, problem)
    return Verdict(fix, FixState.ACTIVE, f"{len(port.pins)} hook(s)")


def pin_problem(pins: dict, fingerprint_fn=None, review: bool = False) -> str:
    """'' when every pinned target ({Hook: reviewed fingerprint}) has its reviewed source, else the one-line
    reason (a review judges a moved target anyway, missing ones still refuse)."""
    from sglang_patches.fingerprint import TargetNotFound, fingerprint

    fingerprint_fn = fingerprint_fn or fingerprint
    for hook, want in pins.items():
        try:
            got = fingerprint_fn(hook.target)
        except TargetNotFound as e:
            return f"hook target missing: {e}"
        if got != want and not review:
            return f"source of {hook.target} changed (fingerprint {got} != reviewed {want})"
    return ""
