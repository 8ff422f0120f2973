"""Regression tests for the DP-attention fix set, on real SGLang 0.5.23 code (the main environment).

Each scenario in `sglang_patches/scenarios/dp.py` runs twice, in separate processes: with SGLang's own
`load_plugins()` discovering our installed entry point, and with `SGLANG_PLUGINS=none` (stock
SGLang). What each must show follows from 0.5.23's port table (`dp_scenarios.expected`): a hooked
fix's defects fail stock with their needle and pass with the plugin; everything else passes both.
`test_version_matrix.py` runs the same list on every other release, `test_diffs.py` on patched trees.
"""
import pytest

from sglang_patches.scenarios import dp as dp_scenarios

VARIANT = "0.5.23"


def _hooked():
    from sglang_patches.registry import all_fixes
    from sglang_patches.states import FixState

    return [f.name for f in all_fixes() if f.family == "dp-attention" and f.ports[VARIANT].state is FixState.ACTIVE]


def _registered():
    """What the plugin registers outside a CPU engine: the hooked DP, R3 and weight-update fixes and the features."""
    from sglang_patches.registry import all_fixes
    from sglang_patches.states import FixState

    return [f.name for f in all_fixes() if f.family in ("dp-attention", "r3", "weight-update", "feature")
            and f.ports[VARIANT].state is FixState.ACTIVE]


def _check_fix(results, fix):
    names = [n for n, (f, kind) in dp_scenarios.KIND.items() if f == fix and kind == "defect"]
    assert names, f"{fix}: no defect scenario"
    for name in names:
        needle, _ = dp_scenarios.expected(VARIANT)[name]
        stock, fixed = results["none"][name], results["plugin"][name]
        assert not stock["ok"] and needle in stock["detail"], f"{name}: stock SGLang: {stock['detail']}"
        assert fixed["ok"], f"{name}: still wrong with the plugin: {fixed['detail']} {fixed.get('trace', '')}"


def test_plugin_loaded_by_sglang_entry_point(dp_results):
    assert dp_results["plugin"]["_meta"]["registered"] == _registered()
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
    (1 token a request) keeps SGLang's own [4, 4] on both (aligning it to k too makes it [6, 6]: 6 rows
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


GUARDS = [n for n, (needle, _) in dp_scenarios.expected(VARIANT).items() if needle is None]


@pytest.mark.parametrize("name", GUARDS)
def test_unaffected_paths_stay_correct(dp_results, name):
    for state in ("none", "plugin"):
        assert dp_results[state][name]["ok"], f"{state}: {dp_results[state][name]['detail']}"


LATENT = [n for n, (needle, plugin_ok) in dp_scenarios.expected(VARIANT).items() if needle is not None and not plugin_ok]


@pytest.mark.parametrize("name", LATENT)
def test_latent_defect_shows_with_and_without_the_plugin(dp_results, name):
    """A not-needed fix's defect (e.g. sglang#37949's off-path rows): the specific wrong result in both states."""
    needle = dp_scenarios.expected(VARIANT)[name][0]
    for state in ("none", "plugin"):
        got = dp_results[state][name]
        assert not got["ok"] and needle in got["detail"], f"{state}: {got['detail']}"


def test_every_fix_has_scenarios():
    from sglang_patches.registry import all_fixes

    for fix in _hooked():
        assert fix in {f for f, kind in dp_scenarios.KIND.values() if kind == "defect"}, fix
    for fix in all_fixes():
        if fix.name in _hooked():
            assert fix.test == f"tests/test_dp_fixes.py::test_{fix.name.replace('-', '_')}"


@pytest.fixture(scope="module")
def dp_results():
    from support.variant_runs import scenarios

    return scenarios("0.5.23")   # every scenario list in one interpreter, shared with the release matrix
