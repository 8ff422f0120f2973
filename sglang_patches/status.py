"""What the plugin does in this environment: SGLang version, entry point, and each fix's state."""
import os
from importlib.metadata import entry_points

from sglang_patches.plugin import PLUGIN_NAME
from sglang_patches.registry import all_fixes, detect, judge
from sglang_patches.states import FixState

GOOD_STATES = tuple(s for s in FixState if s.good)


def plugin_problem():
    """None when SGLang will load our plugin in its processes, else the reason it won't."""
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == PLUGIN_NAME]
    if not eps:
        return f"entry point {PLUGIN_NAME} (group sglang.srt.plugins) is not installed"
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        return f"SGLANG_PLUGINS={allowed} excludes {PLUGIN_NAME}"
    return None


def collect() -> dict:
    found = detect()
    problem = plugin_problem()
    rows = []
    for fix in all_fixes():
        v = judge(fix, found)
        state, reason = v.state, v.reason
        if problem and state is FixState.ACTIVE:
            state, reason = FixState.REFUSED, problem
        rows.append(
            {"name": fix.name, "family": fix.family, "state": state.value, "reason": reason,
             "test": fix.test, "reference": fix.reference}
        )
    ok = all(FixState(r["state"]).good for r in rows)
    return {"sglang_version": found.version, "variant": found.variant.name if found.variant else None,
            "variant_problem": found.refusal, "plugin": PLUGIN_NAME, "plugin_problem": problem, "ok": ok, "fixes": rows}


def fixes_for_config(server_args: dict) -> list:
    """Which fixes a configuration (a dict of ServerArgs fields) needs, and their state here."""
    found = detect()
    out = []
    for fix in all_fixes():
        v = judge(fix, found)
        needed = bool(fix.needed(server_args)) if fix.needed else False
        out.append({"name": fix.name, "needed": needed, "state": v.state.value, "reason": v.reason})
    return out
