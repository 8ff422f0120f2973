"""sglang#37949 is not reached, and sglang#38717 against routed-experts-rows.

- accepted-path-rows (sglang#37949): the defect shows on every reviewed release (`sglang_patches/scenarios/dp.py`:
  `accepted_path_rows_topk2`, latent in tests/test_version_matrix.py); no supported configuration drafts
  top-k > 1 with routed experts, config check refuses it with one line, and inside the engine the plugin
  refuses the capturer with one log line (`sglang_patches/scenarios/tree_capture.py`, on every release with an environment).
- sglang#38717 (open) sizes the capture buffer by request capacity x verify width; routed-experts-rows
  covers that and the prefill-graph and unchunked cases #38717 leaves out: keep it after #38717 merges.
"""
import inspect

import pytest
import yaml

from sglang_patches.registry import VARIANTS
from support.variant_runs import scenarios
from support import ROOT


def test_accepted_path_rows_not_reached(tmp_path, capsys):
    """Why sglang#37949 is not-needed: no shipped config or engine preset drafts top-k > 1 with routed
    experts, the one engine test that drafts top-k 2 reads no routed experts, and config check refuses
    top-k > 1 with routed experts in one line."""
    import test_sgl_kernel_cpu
    from rollout import config as rconfig
    from rollout.cli import main
    from training_configs.schema import load_config, shipped_configs

    spec_r3 = 0
    for path in shipped_configs():
        for g in load_config(path).engine_groups:
            if g.routed_experts and g.speculative:
                spec_r3 += 1
                assert g.speculative.eagle_topk == 1, (path, g.name)
    assert spec_r3 >= 3
    for name in rconfig.PRESETS:
        for g in rconfig.load(name).engine_groups:
            assert not (g.routed_experts and g.speculative and g.speculative.eagle_topk > 1), name
    src = inspect.getsource(test_sgl_kernel_cpu.test_nextn_topk2_through_substitute_equals_transformers)
    assert "eagle_topk=2" in src and "return_routed_experts" not in src

    glm = yaml.safe_load((ROOT / "training_configs" / "glm4.5-355b-a32b.yaml").read_text())
    glm["engine_groups"][0]["speculative"].update(eagle_topk=2, num_draft_tokens=4)
    bad = tmp_path / "topk2.yaml"
    bad.write_text(yaml.safe_dump(glm))
    rc = main(["config", "check", str(bad), "--no-sglang"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "eagle_topk: 2 with routed experts" in err[0] and "sglang#37949" in err[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", [v.name for v in VARIANTS])
def test_engine_refuses_tree_capture(variant):
    """SGLang's own RoutedExpertsCapturer.__init__ with EAGLE top-k 2: stock builds it (its rows would follow
    the tree, sglang#37949); with the plugin it is refused with one log line. Top-k 1 builds in both."""
    res = scenarios(variant)   # the tree-capture list runs with the others (scenarios/every.py)
    stock, plugin = res["none"]["tree_capture_topk2"], res["plugin"]["tree_capture_topk2"]
    assert not stock["ok"] and "EAGLE top-k 2: built a capturer" in stock["detail"], stock
    assert plugin["ok"] and plugin["detail"].startswith(
        "slime-moe-rollout: routed-expert capture refused: speculative EAGLE top-k 2"), plugin
    assert res["none"]["tree_capture_topk1"]["ok"] and res["plugin"]["tree_capture_topk1"]["ok"], res


def _rows_38717(*, cps, mrr, num_dp, attn_tp, k, decode_graph_bs=()):
    """sglang#38717's sizing as its description states it, on SGLang's own `max(chunked_prefill_size, ...)`:
    the largest aligned eager/graph request capacity times the largest verify width, DP-scaled once."""
    requests = -(-max(mrr, max(decode_graph_bs, default=0)) // attn_tp) * attn_tp
    return max(cps, requests * (k or 1)) * num_dp


@pytest.mark.parametrize("cps,mrr,num_dp,attn_tp,k,prefill_bs,covered_by_38717", [
    (1024, 1024, 4, 8, 4, (), True),                   # verify: mrr x k (both cover it)
    (2048, 256, 4, 8, None, (), True),                 # plain: chunked prefill dominates (both)
    (1024, 256, 4, 8, None, (512, 1024, 2048), False),  # a prefill-graph bucket above chunked prefill
    (-1, 256, 2, 2, None, (), False),                  # unchunked: one long prompt per rank
])
def test_routed_experts_rows_covers_38717(cps, mrr, num_dp, attn_tp, k, prefill_bs, covered_by_38717):
    from sglang_patches.fixes.routed_experts_rows import rows_needed

    ctx = 4096
    per_rank_need = max(cps if cps > 0 else ctx, max(prefill_bs, default=0), mrr * (k or 1))
    ours = rows_needed(chunked_prefill_size=cps, context_len=ctx, max_running_requests=mrr, num_dp_ranks=num_dp,
                       attn_tp_size=attn_tp, prefill_graph_tokens=prefill_bs, draft_tokens=k)
    theirs = _rows_38717(cps=cps, mrr=mrr, num_dp=num_dp, attn_tp=attn_tp, k=k)
    assert ours >= per_rank_need * num_dp and ours >= theirs
    assert (theirs >= per_rank_need * num_dp) == covered_by_38717
