"""Run in one release's interpreter: SGLang's own `load_plugins()`, then the wrapped
`TokenizerControlMixin.get_internal_state` called on a real `TokenizerManager` object (made without
`__init__`: its scheduler round trip is replaced by one answer of SGLang's own GetInternalStateReqOutput),
for three plugin states: as loaded; a needed fix disabled; an unreviewed release. Prints REPORT <json>."""
import asyncio
import json
import os
import sys
from types import SimpleNamespace


def server_info(tm) -> dict:
    return {"internal_states": asyncio.run(tm.get_internal_state())}


def main():
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins import load_plugins

    from sglang_patches import report
    from sglang_patches.registry import all_fixes, detect, judge

    load_plugins()
    tm = object.__new__(TokenizerManager)
    tm.auto_create_handle_loop = lambda: None

    async def communicator(req):
        return [GetInternalStateReqOutput(internal_state={"rank": 0}), GetInternalStateReqOutput(internal_state={"rank": 1})]

    tm.get_internal_state_communicator = communicator
    tm.server_args = SimpleNamespace(enable_return_routed_experts=True, tp_size=1, dp_size=1)   # needs routed-experts-rows
    tm.model_config = SimpleNamespace(hf_config=SimpleNamespace())
    out = {}
    info = server_info(tm)
    out["loaded"] = {"problem": report.problem(info), "states": info["internal_states"]}
    for case, env in (("disabled", {"SLIME_MOE_ROLLOUT_DISABLE": "routed-experts-rows"}),
                      ("unreviewed", {"SLIME_MOE_ROLLOUT_REVIEW_AS": "0.0.0"})):
        os.environ.update(env)
        found = detect()
        report.record(found.version, found.refusal, [judge(f, found) for f in all_fixes()])
        out[case] = {"problem": report.problem(server_info(tm))}
        for k in env:
            del os.environ[k]
    print("REPORT " + json.dumps(out, default=str))


if __name__ == "__main__":
    sys.exit(main())
