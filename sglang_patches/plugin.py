"""SGLang general-plugin entry point (group `sglang.srt.plugins`).

SGLang calls `register()` in every server process (launcher, scheduler, detokenizer,
DP controller). Each fix is judged first; only active fixes register hooks, and every
refusal is logged on one line.
"""
import logging

PLUGIN_NAME = "slime_moe_rollout"
logger = logging.getLogger("slime_moe_rollout")

_registered = []  # names of fixes whose hooks this process registered


def register() -> list:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_patches.registry import all_fixes, judge, sglang_version, version_refusal

    if _registered:
        return list(_registered)
    ver = sglang_version()
    refusal = version_refusal(ver)
    if refusal:
        logger.error("slime-moe-rollout: no fixes applied: %s", refusal)
        return []
    for fix in all_fixes():
        verdict = judge(fix, ver)
        if verdict.state == "active":
            for hook in fix.hooks:
                HookRegistry.register(hook.target, hook.fn, HookType[hook.kind.upper()])
            _registered.append(fix.name)
        elif verdict.state == "refused":
            logger.warning("slime-moe-rollout: fix %s refused: %s", fix.name, verdict.reason)
    logger.warning("slime-moe-rollout plugin: active fixes: %s", ", ".join(_registered) or "none")
    return list(_registered)
