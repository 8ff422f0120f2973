"""scripts/check_parity.py's comparison, without engines or slime: a difference the harness cannot explain is a
[DIFF] line naming the field (and the run exits 1); plugin mode's deliberate differences are [explained] with
their reason; equal fields are listed. The samples are duck-typed stand-ins with slime's `Sample` field names."""
import copy
import enum
import importlib.util
import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.timeout(30)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("check_parity", os.path.join(ROOT, "scripts", "check_parity.py"))
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


class Status(enum.Enum):   # slime's Sample.Status values
    COMPLETED = "completed"
    TRUNCATED = "truncated"


def sample(index, prompt="p", tokens=(1, 2, 3, 4), **kw):
    base = dict(index=index, prompt=prompt, tokens=list(tokens), response="<3><4>", response_length=2,
                loss_mask=[1, 1], status=Status.TRUNCATED, reward=2.0, weight_versions=["default"], metadata={},
                rollout_log_probs=[-0.5, -0.25], rollout_routed_experts=None, prefix_cache_info=(0, 2))
    base.update(kw)
    return SimpleNamespace(**base)


def output(groups, metrics=None):
    return SimpleNamespace(samples=groups, metrics=dict(metrics or {}))


def lines_of(slime_out, ours_out, asked=False, same_groups=True):
    return cp.summarize("s", cp.compare_outputs(slime_out, ours_out, asked_experts=asked, same_groups=same_groups))


def test_equal_outputs_list_every_field_and_pass():
    a = output([[sample(0), sample(1)]], {"rollout/zero_std/x": 1})
    lines, bad = lines_of(a, copy.deepcopy(a))
    assert not bad and lines[0].startswith("[equal] s: ")
    for field in ("tokens", "loss_mask", "status", "reward", "rollout_log_probs", "rollout_routed_experts",
                  "metadata", "metrics keys"):
        assert field in lines[0]


def test_a_token_difference_is_a_diff_naming_field_and_index():
    a = output([[sample(0), sample(1)]])
    b = output([[sample(0), sample(1, tokens=[1, 2, 3, 5])]])
    lines, bad = lines_of(a, b)
    assert bad and any(ln.startswith("[DIFF] s: tokens: index 1: slime [1, 2, 3, 4] ours [1, 2, 3, 5]")
                       for ln in lines), lines
    assert "tokens" not in lines[0]   # not also listed as equal


@pytest.mark.parametrize("field,ours", [("loss_mask", [0, 1]), ("status", Status.COMPLETED), ("reward", 1.0),
                                        ("metadata", {"start_rollout_id": 0})])
def test_each_slime_field_is_compared(field, ours):
    lines, bad = lines_of(output([[sample(0)]]), output([[sample(0, **{field: ours})]]))
    assert bad and any(ln.startswith(f"[DIFF] s: {field}: index 0") for ln in lines), lines


def test_logprobs_within_the_tolerance_are_equal_beyond_it_a_diff():
    near = output([[sample(0, rollout_log_probs=[-0.5, -0.25 + cp.LOGPROB_TOL / 2])]])
    lines, bad = lines_of(output([[sample(0)]]), near)
    assert not bad and "logprobs max |diff|" in lines[0]
    far = output([[sample(0, rollout_log_probs=[-0.5, -0.25 + cp.LOGPROB_TOL * 2])]])
    lines, bad = lines_of(output([[sample(0)]]), far)
    assert bad and any(ln.startswith("[DIFF] s: rollout_log_probs:") for ln in lines)


def test_routed_experts_missing_on_slimes_router_path_is_explained_only_when_asked_for():
    ours = output([[sample(0, rollout_routed_experts=[[[1, 2]], [[3, 4]], [[5, 6]]])]])
    lines, bad = lines_of(output([[sample(0)]]), ours, asked=True)
    assert not bad and any(ln.startswith("[explained] s: rollout_routed_experts: slime's own path posts through "
                                         "slime's router") for ln in lines), lines
    lines, bad = lines_of(output([[sample(0)]]), ours, asked=False)   # not asked for: a real difference
    assert bad and any(ln.startswith("[DIFF] s: rollout_routed_experts:") for ln in lines)
    lines, bad = lines_of(ours, output([[sample(0, rollout_routed_experts=[[[9, 9]], [[3, 4]], [[5, 6]]])]]),
                          asked=True)
    assert bad and any("routed experts rows differ" in ln for ln in lines)


def test_placement_moves_cached_tokens_explained():
    lines, bad = lines_of(output([[sample(0)]]), output([[sample(0, prefix_cache_info=(2, 2))]]))
    assert not bad and any(ln.startswith("[explained] s: prefix_cache_info: placement") for ln in lines)


def test_metrics_keys_slimes_must_all_be_there_ours_extra_explained():
    a = output([[sample(0)]], {"rollout/dynamic_filter/drop_x": 1})
    lines, bad = lines_of(a, output([[sample(0)]], {"rollout/groups": 1}))
    assert bad and any(ln.startswith("[DIFF] s: metrics keys: slime's ['rollout/dynamic_filter/drop_x'] missing")
                       for ln in lines)
    lines, bad = lines_of(a, output([[sample(0)]], {"rollout/dynamic_filter/drop_x": 1, "rollout/groups": 1}))
    assert not bad and any(ln.startswith("[explained] s: extra metrics keys: plugin mode adds") for ln in lines)


def test_group_counts_and_indices():
    a = output([[sample(0)], [sample(1)]])
    lines, bad = lines_of(a, output([[sample(0)], [sample(1)], [sample(2)]]), same_groups=False)
    assert bad and any("slime returned 2 groups, ours 3" in ln for ln in lines)
    b = output([[sample(0)], [sample(2)]])
    assert lines_of(a, b, same_groups=True)[1]   # slime's semantics fix the groups: index 1 vs 2 is a difference
    lines, bad = lines_of(a, b, same_groups=False)   # timing picks the groups: only index 0 is compared
    assert not bad, lines
    lines, bad = lines_of(a, output([[sample(5)], [sample(6)]]), same_groups=False)
    assert bad and any("no sample index returned by both" in ln for ln in lines)


def test_a_custom_functions_list_fan_out_is_opened():
    a = output([[[sample(0), sample(1)]]])
    assert not lines_of(a, copy.deepcopy(a))[1]


def test_greedy_prompts_hold_one_completion_across_sides_and_steps():
    a, b = output([[sample(0, prompt="x")]]), output([[sample(2, prompt="x", tokens=[1, 2, 3, 9])]])
    got = cp.same_prompt_same_tokens(a, b)
    assert got[0][0] == "DIFF" and "'x'" in got[0][2]
    assert cp.same_prompt_same_tokens(a, copy.deepcopy(a))[0][0] == "equal"


def test_a_stragglers_cut_point_is_timing_only_for_samples_continued_from_the_buffer():
    a = output([[sample(4, loss_mask=[0, 0])]])
    b = output([[sample(4, loss_mask=[0, 1])]])
    lines, bad = cp.summarize("s", cp.compare_outputs(a, b, asked_experts=False, same_groups=False, cut={4}))
    assert not bad and any(ln.startswith("[explained] s: loss_mask: where a straggler is cut is timing")
                           for ln in lines), lines
    lines, bad = cp.summarize("s", cp.compare_outputs(a, b, asked_experts=False, same_groups=False, cut={5}))
    assert bad and any(ln.startswith("[DIFF] s: loss_mask: index 4") for ln in lines)


def test_a_cut_changes_weight_version_count_and_start_rollout_id_only_for_continued_samples():
    """Seen on real engines: slime held index 4 whole (one answer), ours cut it (two answers); slime held index 6
    with tokens (start_rollout_id set), ours without. Other versions or other metadata stay a DIFF."""
    a = output([[sample(4, weight_versions=["default"]), sample(6, metadata={"start_rollout_id": 0})]])
    b = output([[sample(4, weight_versions=["default", "default"]), sample(6, metadata={})]])
    lines, bad = cp.summarize("s", cp.compare_outputs(a, b, asked_experts=False, same_groups=False, cut={4, 6}))
    assert not bad and any(ln.startswith("[explained] s: weight_versions: where a straggler is cut") for ln in lines)
    assert any(ln.startswith("[explained] s: metadata: where a straggler is cut") for ln in lines), lines
    lines, bad = cp.summarize("s", cp.compare_outputs(a, b, asked_experts=False, same_groups=False, cut=set()))
    assert bad and any(ln.startswith("[DIFF] s: weight_versions: index 4") for ln in lines)
    c = output([[sample(4, weight_versions=["default", "2"]), sample(6, metadata={"x": 1})]])
    lines, bad = cp.summarize("s", cp.compare_outputs(a, c, asked_experts=False, same_groups=False, cut={4, 6}))
    assert any(ln.startswith("[DIFF] s: weight_versions: index 4") for ln in lines)
    assert any(ln.startswith("[DIFF] s: metadata: index 6") for ln in lines), lines


def test_one_prompt_scenarios_pair_samples_by_place_whichever_groups_filled_the_batch():
    """Seen on real engines: the reward scenario's batch held groups 0 and 2 on slime's side, 1 and 3 on ours: no
    index in common, nothing compared. On one prompt (greedy: one completion) the samples pair by place."""
    a = output([[sample(0), sample(1)], [sample(4), sample(5)]])
    b = output([[sample(2), sample(3)], [sample(6), sample(7, reward=3.0)]])
    lines, bad = cp.summarize("s", cp.compare_outputs(a, b, asked_experts=False, same_groups=False))
    assert bad and any(ln.startswith("[DIFF] s: indices: no sample index returned by both") for ln in lines)
    lines, bad = cp.summarize("s", cp.compare_outputs(a, b, asked_experts=False, same_groups=False, by_order=True))
    assert bad and any(ln.startswith("[DIFF] s: reward: index 3: slime 2.0 ours 3.0") for ln in lines), lines
    assert not any("indices" in ln for ln in lines)
