"""`sglang_patches.in_place`: the registry's pinned AROUND hooks on code outside SGLang's HookRegistry
(slime's functions), all or nothing, applied once, rebound where a module imported the function by name."""
import sys

import pytest

from sglang_patches.fingerprint import fingerprint
from sglang_patches.in_place import wrap_in_place
from sglang_patches.registry import Hook

SRC = "def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x * 2\n"


def twice(original, x):
    return 2 * original(x)


@pytest.fixture
def target(tmp_path, monkeypatch):
    (tmp_path / "in_place_target.py").write_text(SRC)
    (tmp_path / "in_place_user.py").write_text("from in_place_target import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("in_place_target", "in_place_user"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    import in_place_target
    import in_place_user
    return in_place_target, in_place_user


def test_wraps_once_and_rebinds(target):
    mod, user = target
    pins = {Hook("in_place_target.f", twice): fingerprint("in_place_target.f")}
    assert wrap_in_place(pins, rebind=("in_place_user",)) == ""
    assert wrap_in_place(pins, rebind=("in_place_user",)) == ""   # already there: not wrapped twice
    assert mod.f(1) == 4 and user.f(1) == 4 and mod.f.__wrapped__(1) == 2


def test_one_changed_pin_changes_nothing(target):
    mod, _ = target
    pins = {Hook("in_place_target.f", twice): fingerprint("in_place_target.f"),
            Hook("in_place_target.g", twice): "0000000000000000"}
    why = wrap_in_place(pins)
    assert why.startswith("source of in_place_target.g changed (fingerprint "), why
    assert mod.f(1) == 2 and mod.g(1) == 2
