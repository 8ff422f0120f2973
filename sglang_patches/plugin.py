"""SGLang general-plugin entry point (group `sglang.srt.plugins`).

SGLang calls `register()` in every server process (launcher, scheduler, detokenizer,
DP controller). The installed SGLang must be a reviewed variant (else one log line, no hook);
then each fix is judged; only active fixes register hooks, and every
refusal is logged on one line. The list of active fixes is logged once per process on one line
(`ACTIVE_LINE`), which `parse_active_fixes` reads back from a server log. The same state is reported
in `/server_info` (`report.REPORT_KEY`), on every release, for the rollout's admission check.
"""
import logging
from typing import Optional

PLUGIN_NAME = "slime_moe_rollout"
ACTIVE_LINE = "slime-moe-rollout plugin: active fixes:"
logger = logging.getLogger("slime_moe_rollout")

_registered = []  # names of fixes whose hooks this process registered


def register() -> list:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_patches import report
    from sglang_patches.registry import all_fixes, detect, judge, table
    from sglang_patches.states import FixState

    if _registered or report._found:
        return list(_registered)
    found = detect()
    verdicts = [judge(fix, found) for fix in all_fixes()]
    report.record(found.version, found.refusal, verdicts)
    try:   # read-only (adds one key to SGLang's answer): registered reviewed or not
        HookRegistry.register(report.STATE, report.report, HookType.AROUND)
    except Exception as e:
        logger.error("slime-moe-rollout: fix report not registered: %s", e)
    if found.refusal:
        logger.error("slime-moe-rollout: no fixes applied: %s", found.refusal)
        return []
    for fix, verdict in zip(all_fixes(), verdicts):
        if verdict.state is FixState.ACTIVE:
            for hook in table(found.variant.table)[fix.name].hooks:
                HookRegistry.register(hook.target, hook.fn, HookType[hook.kind.upper()])
            _registered.append(fix.name)
        elif verdict.state is FixState.REFUSED:
            logger.warning("slime-moe-rollout: fix %s refused: %s", fix.name, verdict.reason)
    logger.warning("%s %s", ACTIVE_LINE, ", ".join(_registered) or "none")
    return list(_registered)


def parse_active_fixes(text: str) -> Optional[list]:
    """Fix names from the first `ACTIVE_LINE` in a server log, or None if it was never logged."""
    for line in text.splitlines():
        if ACTIVE_LINE in line:
            rest = line.split(ACTIVE_LINE, 1)[1].strip()
            return [] if rest == "none" else [x.strip() for x in rest.split(",") if x.strip()]
    return None
