"""The registry's pinned hooks, applied where SGLang's `HookRegistry` does not reach: slime's functions in
slime's own processes (`rollout.routed_experts.slime_compact`, `slime_replay_padding`).

The parts are the registry's: a `registry.Hook` names the target and its wrapper, a pin is the reviewed
`fingerprint` of the target's source, and `registry.pin_problem` judges the pins. Only AROUND hooks
(`fn(original, *args, **kwargs)`) on module-level functions or on methods of a module-level class
(`pkg.mod.Class.method`: replaced on the class; `rebind` is for functions).
"""
import functools
import importlib
import sys

from sglang_patches.fingerprint import split_target
from sglang_patches.registry import Hook, pin_problem

MARK = "_slime_moe_rollout_hooks"  # on a wrapper: the hooks in it (a wrapper is applied once)


def _key(hook: Hook) -> str:
    return f"{hook.fn.__module__}.{hook.fn.__qualname__}"


def _around(hook: Hook, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return hook.fn(original, *args, **kwargs)

    setattr(wrapper, MARK, getattr(original, MARK, ()) + (_key(hook),))
    return wrapper


def wrap_in_place(pins: dict, rebind: tuple = ()) -> str:
    """All or nothing: when every pinned target ({Hook: reviewed fingerprint}) has its reviewed source, replace
    each by its wrapper in its module and in every module of `rebind` that imported the same function by name.
    Returns '' when the wrappers are in place (already there: nothing done), else the refusal (nothing changed)."""
    problem = pin_problem(pins)
    if problem:
        return problem
    for hook in pins:
        assert hook.kind == "around", hook
        module, qualname = split_target(hook.target)
        owner = importlib.import_module(module)
        for attr in qualname[:-1]:
            owner = getattr(owner, attr)
        name = qualname[-1]
        original = getattr(owner, name)
        if _key(hook) in getattr(original, MARK, ()):
            continue
        wrapped = _around(hook, original)
        for m in [owner, *(sys.modules.get(r) for r in rebind if len(qualname) == 1)]:
            if m is not None and getattr(m, name, None) is original:
                setattr(m, name, wrapped)
    return ""
