"""retraction-rows on every reviewed SGLang variant: `sglang_patches/scenarios/retraction.py` runs SGLang's own
`release_req` / `Req.reset_for_retract` / `get_topk` / `_maybe_collect_routed_experts` in the variant's
environment (0.5.23: the main one), stock and then with the plugin loaded by SGLang's `load_plugins()`.
Stock SGLang returns the re-prefill's rows for the positions sampled before a retraction (the needle);
with the plugin, the rows those tokens were sampled with. `patches status` lists the fix active there.
"""
import json
import subprocess

import pytest

from sglang_patches.registry import VARIANTS
from sglang_patches.scenarios import retraction as rs
from sglang_patches.scenarios.runner import ROOT
from support.variant_runs import python_of, scenarios

FIX = "retraction-rows"
ALL = [v.name for v in VARIANTS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ALL)
def test_retraction_rows_on_variant(variant):
    res = scenarios(variant)   # the retraction list runs with the others (scenarios/every.py)
    assert FIX in res["plugin"]["_meta"]["registered"] and res["none"]["_meta"]["registered"] == []
    for name, needle in rs.EXPECT_STOCK.items():
        stock, fixed = res["none"][name], res["plugin"][name]
        assert not stock["ok"] and needle in stock["detail"], f"{name}: stock SGLang {variant}: {stock}"
        assert fixed["ok"], f"{name}: still wrong with the plugin on {variant}: {fixed}"
    for name in rs.GUARDS:
        for state in ("none", "plugin"):
            assert res[state][name]["ok"], f"{name} ({state}, {variant}): {res[state][name]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["0.5.23"])   # the other variants: test_version_matrix's status test
def test_retraction_rows_status_on_variant(variant):
    r = subprocess.run([str(python_of(variant)), "-m", "rollout.cli", "patches", "status", "--json"],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    report = json.loads(r.stdout)
    assert report["variant"] == variant, report["variant_problem"]
    row = next(f for f in report["fixes"] if f["name"] == FIX)
    assert (row["family"], row["state"], row["reason"]) == ("r3", "active", "3 hook(s)")


def test_splice_and_keep_bounds():
    """The pure row rules: kept rows win for their positions only; a later retraction appends after them."""
    import torch

    from sglang_patches.fixes.retraction_rows import keep, splice

    rows = lambda *ids: torch.tensor(ids, dtype=torch.int32)[:, None, None]  # noqa: E731
    kept = keep(None, 2, rows(12, 13))
    kept = keep(kept, 2, rows(92, 93, 14, 15))
    assert kept[0] == 2 and kept[1].flatten().tolist() == [12, 13, 14, 15]
    assert splice(rows(90, 91, 92, 93, 94, 95, 96), 0, kept).flatten().tolist() == [90, 91, 12, 13, 14, 15, 96]
    assert splice(rows(93, 94), 3, kept).flatten().tolist() == [13, 14]   # collected from a later start
    assert splice(rows(97), 7, kept).flatten().tolist() == [97]            # nothing to replace
    with pytest.raises(ValueError, match="leave a gap"):
        keep(kept, 9, rows(1))


def test_meta_info_states_the_rule():
    """The tokenizer-manager hook: answers carrying routed experts name the rule of the request (its custom_params);
    others pass unchanged. (On a real engine: tests/test_retraction_rows_engine.py reads the key from /generate.)"""
    import asyncio
    from types import SimpleNamespace

    from sglang_patches.fixes.retraction_rows import META_KEY, RECOMPUTED, RULE_KEY, SAMPLING_TIME, state_rule

    async def answers():
        yield {"meta_info": {"routed_experts": None}}
        yield {"meta_info": {"routed_experts": "AAAA"}}

    async def collect(custom_params):
        obj = SimpleNamespace(sampling_params={"custom_params": custom_params})
        return [out["meta_info"].get(META_KEY) async for out in state_rule(answers(), None, obj)]

    assert asyncio.run(collect(None)) == [None, SAMPLING_TIME]
    assert asyncio.run(collect({RULE_KEY: RECOMPUTED})) == [None, RECOMPUTED]
