"""What the plugin does in this environment: SGLang version, entry point, and each fix's `Verdict`."""
import dataclasses
import os
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Optional

from sglang_patches.plugin import PLUGIN_NAME
from sglang_patches.registry import Verdict, all_fixes, detect, judge
from sglang_patches.states import FixState


def plugin_problem():
    """None when SGLang will load our plugin in its processes, else the reason it won't."""
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == PLUGIN_NAME]
    if not eps:
        return f"entry point {PLUGIN_NAME} (group sglang.srt.plugins) is not installed"
    allowed = os.environ.get("SGLANG_PLUGINS", "").strip()
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        return f"SGLANG_PLUGINS={allowed} excludes {PLUGIN_NAME}"
    return None


@dataclass(frozen=True)
class Status:
    sglang_version: Optional[str]
    variant: Optional[str]
    variant_problem: Optional[str]
    plugin_problem: Optional[str]
    verdicts: tuple

    @property
    def ok(self) -> bool:
        return all(v.satisfied for v in self.verdicts)

    def as_dict(self) -> dict:
        return {"sglang_version": self.sglang_version, "variant": self.variant,
                "variant_problem": self.variant_problem, "plugin": PLUGIN_NAME,
                "plugin_problem": self.plugin_problem, "ok": self.ok, "fixes": [v.as_dict() for v in self.verdicts]}


def collect() -> Status:
    found = detect()
    problem = plugin_problem()
    verdicts = []
    for fix in all_fixes():
        v = judge(fix, found)
        if problem and v.state is FixState.ACTIVE:
            v = dataclasses.replace(v, state=FixState.REFUSED, reason=problem)
        verdicts.append(v)
    return Status(found.version, found.variant.name if found.variant else None, found.refusal, problem,
                  tuple(verdicts))


def fixes_for_config(server_args: dict) -> list[Verdict]:
    """Which fixes a configuration (a dict of ServerArgs fields) needs, and their state here."""
    found = detect()
    return [dataclasses.replace(v, needed=bool(v.fix.needed(server_args)) if v.fix.needed else False)
            for v in (judge(fix, found) for fix in all_fixes())]
