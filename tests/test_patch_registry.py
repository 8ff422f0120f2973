"""The fix framework: fingerprints, version registry, refusals, the status CLI."""
import hashlib
import inspect
import json
import subprocess
import sys

import pytest

from sglang_patches import registry
from sglang_patches.fingerprint import TargetNotFound, fingerprint, source_of
from sglang_patches.registry import VARIANTS, Fix, Hook, Port, all_fixes, detect, judge

CLI = [sys.executable, "-m", "rollout.cli"]


def hooked_targets():
    """Targets hooked on the variant installed here."""
    name = detect().variant.name
    return sorted({h.target for f in all_fixes() if name in f.ports for h in f.ports[name].hooks})


@pytest.mark.parametrize("target", hooked_targets())
def test_fingerprint_equals_inspect_getsource(target):
    import pkgutil

    mod, qual = target.rsplit(".", 1)
    obj = getattr(pkgutil.resolve_name(mod), qual)
    assert source_of(target) == inspect.getsource(obj)
    assert fingerprint(target) == hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def test_every_fix_has_a_port_on_every_variant():
    names = {f.name for f in all_fixes()}
    for fix in all_fixes():
        assert fix.defect and fix.reference and fix.test
        if fix.family != "dp-attention":
            continue  # other families may leave a variant unported: idle, or refused with a reason
        for v in VARIANTS:
            assert v.name in fix.ports, f"{fix.name}: no port for {v.name}"
    for v in VARIANTS:
        assert set(registry.table(v.table)) <= names, f"{v.table}: ports for unknown fixes"


def test_adding_a_variant_checklist_holds():
    """What the registry's "Adding a variant" says each variant has: a port table, requirements and an
    environment in MATRIX_ENVS (besides the main environment's 0.5.23), a diff set per hooked fix."""
    from pathlib import Path

    from sglang_patches.diffs import patches
    from sglang_patches.states import FixState

    root = Path(__file__).resolve().parent.parent
    matrix = next(ln for ln in (root / "Makefile").read_text().splitlines() if ln.startswith("MATRIX_ENVS"))
    for v in VARIANTS:
        assert (root / "sglang_patches" / "ports" / f"{v.table}.py").exists(), v.name
        if v.name != "0.5.23" and "+" not in v.name:
            assert (root / "requirements" / f"sglang-{v.version}.txt").exists(), v.name
            assert f" {v.name}" in matrix, f"{v.name} not in MATRIX_ENVS"
        hooked = {f for f, p in registry.table(v.table).items() if p.state is FixState.ACTIVE
                  and next(x for x in all_fixes() if x.name == f).family == "dp-attention"}
        have = {p.name.split("-", 1)[1].removesuffix(".patch") for p in patches(v.name)}
        assert hooked == have, f"{v.name}: hooked {sorted(hooked)}, diffs {sorted(have)}"


def test_hookless_port_needs_a_reason():
    with pytest.raises(AssertionError):
        Port(state="not-needed")
    with pytest.raises(AssertionError):
        Port(state="maybe", reason="r")
    with pytest.raises(AssertionError):  # a hook without its reviewed fingerprint
        Port({Hook("sglang.x.f", None): ""})
    with pytest.raises(AssertionError):  # hooks need the active state
        Port({Hook("sglang.x.f", None): "0123456789abcdef"}, state="upstream", reason="r")
    assert Port(state="not-needed", reason="unreachable").state == "not-needed"


def test_fix_states_on_pinned_sglang():
    """Verdicts on the installed 0.5.23 next to facts of its tree: capturer-extent's hooked targets are the
    sources reviewed (active), and dp_attention has `dp_slot_in`, SGLang's own dp-buffer-sizing fix."""
    import sglang.srt.layers.dp_attention as dpa

    states = {f.name: judge(f, "0.5.23").state for f in all_fixes()}
    measured = {  # on pip's sglang 0.5.23
        "sglang.srt.model_executor.cuda_graph_buffer_registry.CudaGraphBufferRegistry.fill_from": "c217bd61336be489",
        "sglang.srt.state_capturer.base.BaseTopkCapturer.on_forward_end": "e289e633c1082b48"}
    assert {t: fingerprint(t) for t in measured} == measured
    assert states["capturer-extent"] == "active"
    assert hasattr(dpa, "dp_slot_in")
    assert states["dp-buffer-sizing"] == "upstream"


def _fake_fix(monkeypatch, target, pin):
    """A fix named "fake" whose 0.5.23 port hooks `target`, pinned to `pin` (a table entry, as real ports)."""
    real = registry.table
    port = Port({Hook(target, lambda *a: None): pin})
    monkeypatch.setattr(registry, "table", lambda name: {**real(name), "fake": port} if name == "v0_5_23" else real(name))
    return Fix(name="fake", family="dp-attention", defect="d", reference="r", test="t")


def test_fingerprint_mismatch_refuses_with_reason(monkeypatch):
    target = "sglang.srt.layers.dp_attention.dp_slot_in"
    v = judge(_fake_fix(monkeypatch, target, "0000000000000000"), "0.5.23")
    assert v.state == "refused" and "dp_slot_in changed" in v.reason
    assert judge(_fake_fix(monkeypatch, target, fingerprint(target)), "0.5.23").state == "active"


def test_missing_target_refuses(monkeypatch):
    fix = _fake_fix(monkeypatch, "sglang.srt.layers.dp_attention.no_such_fn", "x")
    v = judge(fix, "0.5.23")
    assert v.state == "refused" and "no_such_fn" in v.reason
    with pytest.raises(TargetNotFound):
        source_of("sglang.srt.no_such_module.fn")


@pytest.mark.parametrize("ver,needle", [
    # the 0.5.23 tree here claiming to be 0.5.15.post1: its ModelRunner.forward is neither variant's
    ("0.5.15.post1", "SGLang 0.5.15.post1 with an unknown edit: markers ModelRunner.forward"),
    ("0.5.24", "SGLang 0.5.24 is not a reviewed version (reviewed: 0.5.23, 0.5.15.post1"),
])
def test_unreviewed_variants_refuse_every_hook(ver, needle):
    for fix in all_fixes():
        v = judge(fix, ver)
        assert v.state == "refused" and needle in v.reason


def test_not_installed_refuses(monkeypatch):
    monkeypatch.setattr(registry, "sglang_version", lambda: None)
    assert detect().refusal == "SGLang is not installed"


# ModelRunner.forward's fingerprint as measured on the real trees (facts, not read from the registry):
# pip's sglang 0.5.15.post1, and the same with slime's sglang.patch (THUDM/slime 624b824) applied.
FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
MEASURED_FORWARD = {"0.5.15.post1": "582a0e699291c217", "0.5.15.post1+slime": "b30d0a53bc76792b"}


@pytest.mark.parametrize("variant", sorted(MEASURED_FORWARD))
def test_variant_told_apart_by_markers(variant):
    """The measured digest picks its variant; CI cannot build slime's tree, so detection runs on the digests."""
    found = detect("0.5.15.post1", fingerprint_fn=lambda t: MEASURED_FORWARD[variant] if t == FORWARD else "x")
    assert found.variant.name == variant and found.refusal is None


def test_unknown_forward_digest_refuses():
    found = detect("0.5.15.post1", fingerprint_fn=lambda t: "0000000000000000")
    assert found.refusal and "unknown edit" in found.refusal


def test_unknown_marker_edit_refuses_with_one_line():
    found = detect("0.5.15.post1", fingerprint_fn=lambda t: "0123456789abcdef")
    assert found.variant is None and "\n" not in found.refusal
    assert found.refusal.startswith("SGLang 0.5.15.post1 with an unknown edit: markers ModelRunner.forward "
                                    "0123456789abcdef match no reviewed variant (0.5.15.post1, 0.5.15.post1+slime)")


def test_plugin_logs_one_line_and_hooks_nothing_on_unknown_variant(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_patches import plugin, report

    monkeypatch.setattr(registry, "VARIANTS", (registry.Variant("0.5.23", "0.5.23", "v0_5_23", {
        registry.MODEL_RUNNER_FORWARD: "0000000000000000"}),))
    monkeypatch.setattr(plugin, "_registered", [])
    monkeypatch.setattr(report, "_found", {})
    registered = []
    monkeypatch.setattr(HookRegistry, "register", lambda *a, **kw: registered.append(a))
    with caplog.at_level("WARNING", logger="slime_moe_rollout"):
        assert plugin.register() == []
    assert [a[0] for a in registered] == [report.STATE]   # only the read-only fix report: no fix hooked
    assert [r.getMessage() for r in caplog.records] == [
        "slime-moe-rollout: no fixes applied: SGLang 0.5.23 with an unknown edit: markers "
        "ModelRunner.forward " + fingerprint(registry.MODEL_RUNNER_FORWARD) + " match no reviewed variant (0.5.23)"]


def test_disable_env(monkeypatch):
    monkeypatch.setenv(registry.DISABLE_ENV, "capturer-extent")
    states = {f.name: judge(f, "0.5.23").state for f in all_fixes()}
    assert states["capturer-extent"] == "disabled" and states["verify-padding-lcm"] == "active"


def _cli(*args, env=None):
    import os

    e = dict(os.environ)
    e.pop("SGLANG_PLUGINS", None)
    e.update(env or {})
    return subprocess.run(CLI + list(args), capture_output=True, text=True, env=e, timeout=120)


def test_status_cli_json_and_exit_codes():
    ok = _cli("patches", "status", "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["sglang_version"] == "0.5.23" and report["variant"] == "0.5.23" and report["ok"]
    excluded = _cli("patches", "status", env={"SGLANG_PLUGINS": "someone_else"})
    assert excluded.returncode == 1
    assert "excludes slime_moe_rollout" in excluded.stdout
    assert excluded.stderr.strip().count("\n") == 0 and excluded.stderr.startswith("error: ")


def test_bad_cli_argument_one_line_exit_2():
    r = _cli("patches", "frobnicate")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
