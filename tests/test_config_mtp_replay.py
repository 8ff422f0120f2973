"""`config check` says which R3 rule applies to Megatron MTP layers (mtp_num_layers) on the seed config.

The rule (training_configs/replay_check.py): the MTP routers route on their own; the rendered init hook
takes them out of slime's replay (tests/test_r3_mtp_slime.py runs slime's own fill_routing_replay).
"""
import os

import pytest
import yaml

from rollout.cli import main
from training_configs.render import REPLAY_PADDING_INIT, render
from training_configs.schema import load_config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(HERE, "training_configs", "glm4.5-355b-a32b.yaml")
pytestmark = pytest.mark.timeout(60)


def _seed(tmp_path, megatron_extra=None, slime_extra=None, routed=True):
    with open(SEED) as fh:
        data = yaml.safe_load(fh)
    data["megatron"]["extra_args"].update(megatron_extra or {})
    data.setdefault("slime", {}).setdefault("extra_args", {}).update(slime_extra or {})
    for g in data["engine_groups"]:
        g["routed_experts"] = routed
    f = tmp_path / "seed-mtp.yaml"
    f.write_text(yaml.safe_dump(data))
    return str(f)


def _check(capsys, path):
    rc = main(["config", "check", path, "--no-sglang"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_mtp_with_r3_names_the_rule_and_the_rendered_init(tmp_path, capsys):
    path = _seed(tmp_path, megatron_extra={"mtp_num_layers": 1})
    out = _check(capsys, path)
    notes = [line for line in out.splitlines() if "MTP layers" in line]
    assert notes == [f"note: MTP layers (mtp_num_layers 1) with R3: SGLang captures the target layers only, so the "
                     f"MTP routers route on their own (the rendered --custom-megatron-init-path {REPLAY_PADDING_INIT} "
                     "takes them out of slime's replay, which asserts otherwise: slime#1556)"], out
    assert f"--custom-megatron-init-path {REPLAY_PADDING_INIT}" in render(load_config(path), "slime-args")


def test_mtp_with_r3_and_the_users_own_init_warns(tmp_path, capsys):
    out = _check(capsys, _seed(tmp_path, megatron_extra={"mtp-num-layers": 2},
                               slime_extra={"custom_megatron_init_path": "my.init"}))
    assert ("warning: MTP layers (mtp_num_layers 2) with R3: SGLang captures the target layers only, so the MTP "
            f"routers route on their own; your custom_megatron_init_path my.init must call {REPLAY_PADDING_INIT}"
            "(args), or slime's fill_routing_replay asserts (slime#1556)") in out.splitlines(), out


def test_no_rule_without_mtp_or_without_r3(tmp_path, capsys):
    assert "MTP layers" not in _check(capsys, _seed(tmp_path))
    assert "MTP layers" not in _check(capsys, _seed(tmp_path, megatron_extra={"mtp_num_layers": 1}, routed=False))
    out = _check(capsys, _seed(tmp_path, megatron_extra={"mtp_num_layers": 1}, routed=False,
                               slime_extra={"use_rollout_routing_replay": True}))
    assert "warning: MTP layers (mtp_num_layers 1) with R3" in out and "no engine group sets routed_experts" in out
