"""`slime-moe-rollout patches review VERSION`: a draft review of an SGLang release (from a checkout).

It builds the release's environment (`scripts/setup_sglang_env.sh VERSION`, which needs
`requirements/sglang-VERSION.txt`), fingerprints every target any port table hooks there, runs the
scenario list (`sglang_patches.scenarios.dp`) on the stock tree and with the plugin judging the tree as the
nearest reviewed variant (`registry.REVIEW_AS_ENV`: hooks register whatever the fingerprints say),
and prints which port fits unchanged, which targets moved, which scenarios fail stock and pass with
the plugin, and a draft verdict per fix. The verdicts are a draft: read every moved target's source
before pinning it in a port table.
"""
import json
import subprocess
from pathlib import Path

from sglang_patches.errors import CliError

ROOT = Path(__file__).resolve().parent.parent


class ReviewError(CliError):
    """The review cannot go on (one line, exit 2)."""


def short(target: str) -> str:
    return ".".join(target.rsplit(".", 2)[-2:])


def pinned_targets(family: str = None) -> dict:
    """{variant name: {fix name: {target: pinned fingerprint}}} over every table's hooked ports (of `family`)."""
    from sglang_patches.registry import VARIANTS, all_fixes, table
    from sglang_patches.states import FixState

    names = {f.name for f in all_fixes() if family in (None, f.family)}
    return {v.name: {fix: port.fingerprints for fix, port in table(v.table).items()
                     if port.state is FixState.ACTIVE and fix in names} for v in VARIANTS}


def probe() -> None:
    """In the release's interpreter: print {target: fingerprint or 'missing'} as JSON."""
    from sglang_patches.fingerprint import TargetNotFound, fingerprint

    targets = sorted({t for fixes in pinned_targets().values() for pins in fixes.values() for t in pins})
    out = {}
    for t in targets:
        try:
            out[t] = fingerprint(t)
        except TargetNotFound:
            out[t] = "missing"
    print(json.dumps(out))


def _env_python(version: str) -> Path:
    return ROOT / ".venvs" / f"sglang-{version}" / "bin" / "python"


def _check_checkout(version: str) -> None:
    for rel in ("scripts/setup_sglang_env.sh", f"requirements/sglang-{version}.txt"):
        if not (ROOT / rel).exists():
            raise ReviewError(f"review needs a checkout with {rel} (in {ROOT})")


def _build(version: str) -> None:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_sglang_env.sh"), version], cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise ReviewError(f"building the {version} environment failed: "
                          f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")


def _installed_fingerprints(python: Path) -> dict:
    r = subprocess.run([str(python), "-m", "sglang_patches.review"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise ReviewError(f"fingerprint probe failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _scenarios(python: Path, review_as: str) -> dict:
    from sglang_patches.registry import REVIEW_AS_ENV
    from sglang_patches.scenarios.runner import run_states

    return run_states(["both"], python=python, timeout=900, extra_env={"both": {REVIEW_AS_ENV: review_as}})


def nearest(installed: dict, pins: dict) -> str:
    """The variant whose hooked pins match the installed tree most often (later variants win ties);
    `review` passes the DP-attention family's pins: the CPU graph family would pull every tree to 0.5.23."""
    score = {v: sum(installed.get(t) == d for fix in fixes.values() for t, d in fix.items()) for v, fixes in pins.items()}
    return max(reversed(list(score)), key=lambda v: score[v])


def draft(version: str, installed: dict, pins: dict, results: dict, review_as: str) -> list:
    """The report's lines."""
    from sglang_patches.registry import VARIANTS, all_fixes, table
    from sglang_patches.scenarios.dp import KIND
    from sglang_patches.states import FixState

    names = [v.name for v in VARIANTS]
    lines = [f"SGLang {version} review: scenario driver {results['none']['_meta'].get('driver')}, plugin judged as "
             f"{review_as} (nearest by fingerprints)", "", "hooked target fingerprints ('=' matches that variant's pin)"]
    lines.append(f"  {'target':<52} {'installed':<17} " + " ".join(f"{n:<18}" for n in names))
    for t, got in sorted(installed.items()):
        cells = []
        for n in names:
            pinned = {d for fix in pins[n].values() for tt, d in fix.items() if tt == t}
            cells.append("=" if got in pinned else ("moved" if pinned else "-"))
        lines.append(f"  {short(t):<52} {got:<17} " + " ".join(f"{c:<18}" for c in cells))
    lines += ["", "scenarios: stock -> plugin"]
    for name, (fix, kind) in KIND.items():
        s, p = results["none"].get(name, {}), results["plugin"].get(name, {})
        mark = lambda r: "ok  " if r.get("ok") else "FAIL"  # noqa: E731
        lines.append(f"  {name:<42} {kind:<6} {mark(s)} -> {mark(p)}  {s.get('detail', '')[:90]}")
    lines += ["", "draft verdicts"]
    for fix in (f for f in all_fixes() if f.family == "dp-attention"):
        defects = [n for n, (f, k) in KIND.items() if f == fix.name and k == "defect"]
        stock_fail = [n for n in defects if not results["none"][n]["ok"]]
        plugin_ok = [n for n in defects if results["plugin"][n]["ok"]]
        fits = [n for n in names if fix.name in pins[n] and all(installed.get(t) == d for t, d in pins[n][fix.name].items())]
        port = table(next(v for v in VARIANTS if v.name == review_as).table).get(fix.name)
        moved = sorted(short(t) for t, d in (port.fingerprints if port else {}).items() if installed.get(t) != d)
        if defects and not stock_fail:
            verdict = "upstream: every defect scenario passes stock (a guard)"
        elif port is None:
            verdict = f"no port on {review_as}"
        elif port.state is not FixState.ACTIVE:
            verdict = f"{port.state.value} on {review_as}: check its reason and reach scenarios here"
        elif len(plugin_ok) == len(defects) and not moved:
            verdict = f"hook: {review_as}'s port fits unchanged"
        elif len(plugin_ok) == len(defects):
            verdict = f"hook: {review_as}'s hooks work; re-pin after reading {', '.join(moved)}"
            if fits:
                verdict += f" (or reuse {fits[-1]}'s port: its pins fit)"
        else:
            bad = next(n for n in defects if n not in plugin_ok)
            verdict = f"hook: {review_as}'s hooks do not fix {bad}: {results['plugin'][bad]['detail'][:80]}"
        lines.append(f"  {fix.name:<26} fails stock {len(stock_fail)}/{len(defects)}, passes with plugin "
                     f"{len(plugin_ok)}/{len(defects)}; pins fit: {', '.join(fits) or 'none'}; {verdict}")
    return lines


def review(version: str, build: bool = True, review_as: str = None) -> list:
    _check_checkout(version)
    if build:
        _build(version)
    python = _env_python(version)
    if not python.exists():
        raise ReviewError(f"{python} missing: run scripts/setup_sglang_env.sh {version}")
    installed = _installed_fingerprints(python)
    pins = pinned_targets()
    review_as = review_as or nearest(installed, pinned_targets("dp-attention"))
    if review_as not in pins:
        raise ReviewError(f"--as {review_as}: not a reviewed variant ({', '.join(pins)})")
    return draft(version, installed, pins, _scenarios(python, review_as), review_as)


if __name__ == "__main__":
    probe()
