"""Every scenario list in one interpreter: the DP-attention scenarios (`dp`), retraction (`retraction`) and
tree capture (`tree_capture`), so a release's environment imports SGLang once per state.

    python -m sglang_patches.scenarios.every STATE    # as the runner runs any scenario module

The version matrix runs it on every reviewed release; each list also runs alone as its own module.
"""
import sys

from sglang_patches.scenarios import dp, retraction, tree_capture

LISTS = (dp.SCENARIOS, retraction.SCENARIOS, tree_capture.SCENARIOS)


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
