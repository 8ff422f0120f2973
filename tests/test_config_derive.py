"""Our copy of SGLang's DP-attention rules equals the installed SGLang's answer on a grid."""
import importlib.util
import itertools
import os

import pytest

from training_configs.derive import our_derive
from training_configs.schema import EngineGroup, load_config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(HERE, "training_configs", "glm4.5-355b-a32b.yaml")


def _group(tp, dp, dense, lm_head, a2a, attn=None):
    attn = dp > 1 if attn is None else attn
    return EngineGroup(name="g", engines=1, gpus_per_engine=tp, tp=tp, dp=dp, ep=tp if a2a != "none" else 1,
                       moe_dense_tp=dense, enable_dp_attention=attn, enable_dp_lm_head=lm_head and attn,
                       moe_a2a_backend=a2a)


def test_glm45_355b_facts_by_our_rules():
    # the GLM-4.5 355B flags as given (a2a none) vs with --moe-a2a-backend deepep, and a plain tp 8 engine
    lit = our_derive(_group(32, 4, 1, True, "none"))
    assert (lit.attn_tp_size, lit.require_mlp_tp_gather, lit.require_attn_tp_gather) == (8, True, True)
    dee = our_derive(_group(32, 4, 1, True, "deepep"))
    assert (dee.attn_tp_size, dee.require_mlp_tp_gather, dee.require_attn_tp_gather) == (8, False, True)
    plain = our_derive(_group(8, 1, None, False, "none"))
    assert (plain.attn_tp_size, plain.require_mlp_tp_gather, plain.require_attn_tp_gather) == (8, False, False)


def _grid():
    # flashinfer a2a is left out: SGLang also needs a flashinfer MoE runner for it (it rejects the grid point)
    for tp, a2a, dense, lm_head in itertools.product((8, 32), ("none", "deepep", "mooncake"),
                                                     (None, 1), (False, True)):
        for dp in (1, 2, tp):
            yield tp, dp, dense, lm_head, a2a


GRID = list(_grid())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang not installed")
def test_our_rules_equal_sglang_on_a_grid():
    from training_configs.derive import sglang_derive
    from training_configs.schema import ConfigError
    cfg = load_config(SEED)
    compared, rejected = 0, []
    for tp, dp, dense, lm_head, a2a in GRID:
        g = _group(tp, dp, dense, lm_head, a2a)
        cfg.engine_groups = [g]
        try:
            theirs = sglang_derive(cfg, g)
        except ConfigError as e:  # SGLang refuses some combinations outright; ours must not claim them
            rejected.append((tp, dp, dense, lm_head, a2a, str(e)))
            continue
        assert our_derive(g).facts() == theirs.facts(), (tp, dp, dense, lm_head, a2a)
        compared += 1
    assert compared == len(GRID), rejected[:3]
