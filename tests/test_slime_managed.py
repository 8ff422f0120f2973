"""Managed-engines mode: the addresses slime is given are the ones the manager binds, and the fields
slime's external-engine check compares agree with what SGLang itself reports (`/server_info` is
SGLang's resolved server args), except dp_size under DP attention, which `config check` warns about."""
import importlib.util
import os

import pytest

from rollout.config import engine_specs
from training_configs.render import external_addrs, slime_args
from training_configs.schema import load_config, shipped_configs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_rendered_addresses_are_the_managers_ports(path):
    cfg = load_config(path)
    specs = engine_specs(cfg, "/models/x", api_key="k")
    assert external_addrs(cfg) == [f"{s.host}:{s.port}" for s in specs]
    argv = slime_args(cfg, "managed")
    i = argv.index("--rollout-external-engine-addrs")
    assert argv[i + 1:i + 1 + len(specs)] == external_addrs(cfg)
    assert "--rollout-function-path" not in argv   # slime's own rollout (or ours) goes through its router


def _slime_expected(cfg):
    """The ServerArgs fields slime sets itself for an external engine and compares with /server_info
    (slime-contract §1: tp_size = gpus_per_engine // pp, dp/ep/pp from --sglang-*, R3 flag)."""
    g = cfg.engine_groups[0]
    out = {"tp_size": g.gpus_per_engine // g.pp, "dp_size": g.dp, "pp_size": g.pp, "ep_size": g.ep}
    if g.routed_experts:
        out["enable_return_routed_experts"] = True
    return out


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang not installed")
def test_server_info_fields_match_what_slime_expects():
    from training_configs.check import check_config
    from training_configs.derive import sglang_derive
    plain = load_config(os.path.join(HERE, "training_configs", "tiny-cpu.yaml"))
    resolved = sglang_derive(plain, plain.engine_groups[0]).resolved
    for k, v in _slime_expected(plain).items():
        assert resolved[k] == v, k
    dpattn = load_config(os.path.join(HERE, "training_configs", "tiny-cpu-dpattn.yaml"))
    resolved = sglang_derive(dpattn, dpattn.engine_groups[0]).resolved
    expected = _slime_expected(dpattn)
    assert resolved["dp_size"] == 1 and expected["dp_size"] == 2 and resolved["attn_dp_size"] == 2
    assert all(resolved[k] == v for k, v in expected.items() if k != "dp_size")
    assert any("dp_size 1" in w for w in check_config(dpattn).warnings)
