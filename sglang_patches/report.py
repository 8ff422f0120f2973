"""The plugin's state inside a running engine, in `/server_info`, for the rollout's admission check.

`register()` (plugin.py) records what it found in this process; an AROUND wrapper on
`get_internal_state` (the same place the compact-routed-experts advert uses) adds `REPORT_KEY` to every
`internal_states` entry: the SGLang version, why no variant matched (if so), and each fix's state and
whether this engine's own server args need it. It only adds a key to SGLang's answer, so it is registered
on every release that has the method, reviewed or not. `problem()` turns a report into the one reason an
engine must not be admitted, or None.
"""
from typing import Optional

REPORT_KEY = "slime_moe_rollout.fixes"   # in every /server_info internal_states entry
STATE = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state"

_found = {}   # set by register(): version, refusal, verdicts (Verdict list)


def record(version: Optional[str], refusal: Optional[str], verdicts: list) -> None:
    _found.update(version=version, refusal=refusal, verdicts=list(verdicts))


def build(server_args: dict) -> dict:
    """This process's report for an engine started with `server_args` (ServerArgs fields)."""
    fixes = []
    for v in _found.get("verdicts", ()):
        try:
            needed = bool(v.fix.needed(server_args)) if v.fix.needed else False
        except Exception:      # a predicate that cannot read these args: assume the fix matters
            needed = True
        f = {"name": v.fix.name, "state": v.state.value, "needed": needed, "good": v.state.good}
        if not v.state.good:
            f["reason"] = v.reason
        fixes.append(f)
    return {"sglang_version": _found.get("version"), "refusal": _found.get("refusal"), "fixes": fixes}


def args_of(server_args) -> dict:
    """ServerArgs fields by name: a dataclass's `vars()`, or (0.5.23: a msgspec Struct, whose fields are not in its
    `__dict__`) its `__struct_fields__`."""
    fields = getattr(server_args, "__struct_fields__", None)
    if fields:
        return {f: getattr(server_args, f, None) for f in fields}
    return dict(vars(server_args)) if hasattr(server_args, "__dict__") else {}


async def report(original, self, *args, **kwargs):
    """AROUND get_internal_state: add this engine's fix report to each DP rank's state."""
    states = await original(self, *args, **kwargs)
    try:
        info = build(args_of(getattr(self, "server_args", None)))
    except Exception as e:      # never break /server_info
        info = {"sglang_version": _found.get("version"), "refusal": f"report failed: {e!r}"[:200], "fixes": []}
    for s in states or ():
        if isinstance(s, dict):
            s[REPORT_KEY] = info
    return states


def problem(server_info) -> Optional[str]:
    """Why an engine with this `/server_info` lacks a fix its configuration needs (one line), else None."""
    states = server_info.get("internal_states") if isinstance(server_info, dict) else None
    reports = [s.get(REPORT_KEY) for s in states or () if isinstance(s, dict)]
    if not reports or not all(isinstance(r, dict) for r in reports):
        return ("no slime-moe-rollout fix report in /server_info: the plugin is not loaded in the engine "
                "(not installed there, or excluded by SGLANG_PLUGINS)")
    r = reports[0]
    if r.get("refusal"):
        return f"SGLang {r.get('sglang_version')}: no fixes applied: {r['refusal']}"
    bad = [f for f in r.get("fixes") or () if isinstance(f, dict) and f.get("needed") and not f.get("good")]
    if bad:
        return "needed fixes not active: " + "; ".join(f"{f.get('name')} {f.get('state')} ({f.get('reason')})"
                                                      for f in bad)
    return None
