"""The fix framework: fingerprints, version registry, refusals, the status CLI."""
import hashlib
import inspect
import json
import subprocess
import sys

import pytest

from sglang_patches import registry
from sglang_patches.fingerprint import TargetNotFound, fingerprint, source_of
from sglang_patches.registry import Fix, Hook, all_fixes, judge

CLI = [sys.executable, "-m", "rollout.cli"]


def hooked_targets():
    return sorted({h.target for f in all_fixes() for h in f.hooks})


@pytest.mark.parametrize("target", hooked_targets())
def test_fingerprint_equals_inspect_getsource(target):
    import pkgutil

    mod, qual = target.rsplit(".", 1)
    obj = getattr(pkgutil.resolve_name(mod), qual)
    assert source_of(target) == inspect.getsource(obj)
    assert fingerprint(target) == hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def test_every_active_fix_is_pinned_for_each_version():
    for fix in all_fixes():
        for ver in fix.versions:
            assert {h.target for h in fix.hooks} <= set(fix.fingerprints[ver]), fix.name
        assert fix.defect and fix.reference and fix.test


def test_fix_states_on_pinned_sglang():
    states = {f.name: judge(f, "0.5.23").state for f in all_fixes()}
    assert states["capturer-extent"] == "active"
    assert states["dp-buffer-sizing"] == "upstream"


def _fake_fix(pin):
    return Fix(name="fake", family="dp-attention", defect="d", reference="r", versions=("0.5.23",),
               test="t", hooks=(Hook("sglang.srt.layers.dp_attention.dp_slot_in", lambda *a: None),),
               fingerprints={"0.5.23": {"sglang.srt.layers.dp_attention.dp_slot_in": pin}})


def test_fingerprint_mismatch_refuses_with_reason():
    v = judge(_fake_fix("0000000000000000"), "0.5.23")
    assert v.state == "refused" and "dp_slot_in changed" in v.reason
    assert judge(_fake_fix(fingerprint("sglang.srt.layers.dp_attention.dp_slot_in")), "0.5.23").state == "active"


def test_missing_target_refuses():
    fix = _fake_fix("x")
    fix = Fix(**{**fix.__dict__, "hooks": (Hook("sglang.srt.layers.dp_attention.no_such_fn", None),),
                 "fingerprints": {"0.5.23": {"sglang.srt.layers.dp_attention.no_such_fn": "x"}}})
    v = judge(fix, "0.5.23")
    assert v.state == "refused" and "no_such_fn" in v.reason
    with pytest.raises(TargetNotFound):
        source_of("sglang.srt.no_such_module.fn")


@pytest.mark.parametrize("ver,needle", [
    ("0.5.15.post1", "slime's image pins SGLang 0.5.15.post1"),
    ("0.5.24", "not a reviewed version"),
    (None, "SGLang is not installed"),
])
def test_unreviewed_versions_refuse_every_hook(ver, needle):
    for fix in all_fixes():
        v = judge(fix, ver)
        assert v.state == "refused" and needle in v.reason


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
    assert report["sglang_version"] == "0.5.23" and report["ok"]
    excluded = _cli("patches", "status", env={"SGLANG_PLUGINS": "someone_else"})
    assert excluded.returncode == 1
    assert "excludes slime_moe_rollout" in excluded.stdout
    assert excluded.stderr.strip().count("\n") == 0 and excluded.stderr.startswith("error: ")


def test_bad_cli_argument_one_line_exit_2():
    r = _cli("patches", "frobnicate")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
