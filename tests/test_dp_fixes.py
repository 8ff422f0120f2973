"""Regression tests for the DP-attention fix set, on real SGLang 0.5.23 code.

Each scenario in `dp_scenarios.py` runs twice, in separate processes: with SGLang's own
`load_plugins()` discovering our installed entry point, and with `SGLANG_PLUGINS=none`
(stock SGLang). A fix's test requires the defect to show without the plugin and the correct
behaviour with it. `test_diffs.py` runs the same scenarios on a tree patched by the diffs.
"""
import pytest

FIX_SCENARIOS = {
    "capturer-extent": [
        "capturer_extent_verify_graph",
        "capturer_extent_prefill_graph_first",
        "capturer_extent_prefill_graph_stale_bs",
    ],
    "routed-experts-rows": [
        "routed_experts_rows_verify",
        "routed_experts_rows_prefill_graph",
        "routed_experts_rows_unchunked",
    ],
    "draft-extend-real-rows": ["draft_extend_real_rows"],
    "verify-padding-lcm": ["verify_padding_k3_attn_tp8", "verify_padding_k6_attn_tp4", "verify_padding_ranks_agree_verify"],
}
GUARD_SCENARIOS = [
    "capturer_extent_eager_prefix_sum",
    "routed_experts_rows_default",
    "draft_extend_unpadded_untouched",
    "verify_padding_k4_attn_tp8",
    "verify_padding_ranks_agree_draft_decode",  # the lcm alignment leaves draft decode (1 token a request) alone
    "capture_snapshot_overlap",  # capture-snapshot: upstream in 0.5.23 (sglang#34319)
]


def _check_fix(results, fix):
    for name in FIX_SCENARIOS[fix]:
        stock, fixed = results["none"][name], results["plugin"][name]
        assert not stock["ok"], f"{name}: defect did not show on stock SGLang: {stock['detail']}"
        assert fixed["ok"], f"{name}: still wrong with the plugin: {fixed['detail']} {fixed.get('trace', '')}"


def test_plugin_loaded_by_sglang_entry_point(dp_results):
    assert dp_results["plugin"]["_meta"]["registered"] == list(FIX_SCENARIOS)
    assert dp_results["none"]["_meta"]["registered"] == []


def test_capturer_extent(dp_results):
    _check_fix(dp_results, "capturer-extent")


def test_routed_experts_rows(dp_results):
    _check_fix(dp_results, "routed-experts-rows")


def test_draft_extend_real_rows(dp_results):
    _check_fix(dp_results, "draft-extend-real-rows")


def test_verify_padding_lcm(dp_results):
    _check_fix(dp_results, "verify-padding-lcm")


def test_verify_padding_lcm_pads_by_the_batch_width_alike_on_idle_ranks(dp_results):
    """attn_tp 2, k 3, a busy and an idle DP rank: verify lists pad to lcm 6 on both ranks; draft decode
    (1 token a request) keeps SGLang's own [4, 4] on both (the first version made it [6, 6]: 6 rows
    for 4 requests, more than the draft's eager registry holds)."""
    res = dp_results["plugin"]
    assert res["verify_padding_ranks_agree_verify"]["detail"] == (
        "padded lists [6, 6] / [6, 6] (busy / idle rank); busy rank 6 rows, batch_size 2 x 3")
    assert res["verify_padding_ranks_agree_draft_decode"]["detail"] == (
        "padded lists [4, 4] / [4, 4] (busy / idle rank); busy rank 4 rows, batch_size 4 x 1")
    assert dp_results["none"]["verify_padding_ranks_agree_verify"]["detail"] == (
        "padded lists [4, 4] / [4, 4] (busy / idle rank); busy rank 4 rows, batch_size 1 x 3")


@pytest.mark.parametrize("tp, k, topk, needed", [
    (4, 3, 1, True),    # configuration (c): attn_tp 2, 3 draft tokens
    (16, 4, 1, False),  # attn_tp 8, k 4 (the shipped GPU setting): whole requests already
    (4, 4, 3, True),    # attn_tp 2, k 4, top-k 3: draft decode carries 3 tokens a request
])
def test_verify_padding_lcm_needed(tp, k, topk, needed):
    from sglang_patches.fixes.verify_padding_lcm import needed as fix_needed

    args = {"tp_size": tp, "dp_size": 2, "enable_dp_attention": True, "speculative_algorithm": "EAGLE",
            "speculative_num_draft_tokens": k, "speculative_eagle_topk": topk}
    assert fix_needed(args) is needed


@pytest.mark.parametrize("name", GUARD_SCENARIOS)
def test_unaffected_paths_stay_correct(dp_results, name):
    for state in ("none", "plugin"):
        assert dp_results[state][name]["ok"], f"{state}: {dp_results[state][name]['detail']}"


def test_every_fix_has_scenarios():
    from sglang_patches.registry import all_fixes

    hooked = {f.name for f in all_fixes() if f.family == "dp-attention" and f.ports["0.5.23"].state == "hooks"}
    assert hooked == set(FIX_SCENARIOS)
    for fix in all_fixes():
        if fix.name in FIX_SCENARIOS:
            assert fix.test == f"tests/test_dp_fixes.py::test_{fix.name.replace('-', '_')}"


@pytest.fixture(scope="module")
def dp_results():
    from scenario_runner import run_states

    return run_states(["none", "plugin"])
