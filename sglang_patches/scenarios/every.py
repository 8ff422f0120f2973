"""Every scenario list in one interpreter: the DP-attention scenarios (`dp`), retraction (`retraction`),
tree capture (`tree_capture`) and weight updates (`weight_update`), so a release's environment imports SGLang
once per state.

    python -m sglang_patches.scenarios.every STATE    # as the runner runs any scenario module

The version matrix runs it on every reviewed release; each list also runs alone as its own module.
"""
import sys

from sglang_patches.scenarios import dp, retraction, tree_capture, weight_update

LISTS = (dp.SCENARIOS, retraction.SCENARIOS, tree_capture.SCENARIOS, weight_update.SCENARIOS)


def scenarios() -> dict:
    out = {}
    for one in LISTS:
        clash = sorted(out.keys() & one.keys())
        if clash:
            raise ValueError(f"scenario names in two lists: {', '.join(clash)}")
        out.update(one)
    return out


if __name__ == "__main__":
    dp.run(sys.argv[1], scenarios())
