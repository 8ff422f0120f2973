"""`slime-moe-rollout config check`: the shipped configs pass; malformed ones exit 2 with one line."""
import copy
import importlib.util
import os

import pytest
import yaml

from rollout.cli import main
from sglang_patches.states import FixState
from training_configs.schema import load_config, shipped_configs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = os.path.join(HERE, "training_configs", "glm4.5-355b-a32b.yaml")
TINY = os.path.join(HERE, "training_configs", "tiny-cpu-dpattn.yaml")
R3 = os.path.join(HERE, "training_configs", "tiny-cpu-r3.yaml")


def _raw(path):
    with open(path) as fh:
        return yaml.safe_load(fh)


def _set(d, dotted, value):
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d[int(k)] if isinstance(d, list) else d[k]
    last = keys[-1]
    if value is _DEL:
        del d[last]
    elif isinstance(d, list):
        d[int(last)] = value
    else:
        d[last] = value


_DEL = object()

# (id, base, {dotted path: new value}, substring the one-line error must contain)
MALFORMED = [
    ("missing-model", TINY, {"model": _DEL}, "model: missing required field"),
    ("layers-not-int", TINY, {"model.num_layers": "two"}, "model.num_layers: expected an integer"),
    ("unknown-top-key", TINY, {"modle": {}}, "modle: unknown field"),
    ("no-groups", TINY, {"engine_groups": []}, "at least one engine group"),
    ("groups-not-list", TINY, {"engine_groups": {"a": 1}}, "engine_groups: expected a list"),
    ("tp-not-div-dp", TINY, {"engine_groups.0.dp": 3}, "tp 4 is not divisible by dp 3"),
    ("tp-not-div-ep", SEED, {"engine_groups.0.ep": 3}, "tp 32 is not divisible by ep 3"),
    ("gpus-per-engine", TINY, {"engine_groups.0.gpus_per_engine": 2}, "gpus_per_engine: 2 != tp*pp = 4"),
    ("dp-without-dp-attn", TINY, {"engine_groups.0.enable_dp_attention": False,
                                  "engine_groups.0.enable_dp_lm_head": False}, "requires enable_dp_attention"),
    ("lm-head-without-dp-attn", TINY, {"engine_groups.0.dp": 1, "engine_groups.0.enable_dp_attention": False},
     "enable_dp_lm_head: requires enable_dp_attention"),
    ("dp-attn-dp1", TINY, {"engine_groups.0.dp": 1, "engine_groups.0.enable_dp_lm_head": False},
     "enable_dp_attention: needs dp >= 2"),
    ("dense-tp-3", SEED, {"engine_groups.0.moe_dense_tp": 4}, "moe_dense_tp: SGLang supports 1 or tp"),
    ("experts-not-div-ep", SEED, {"model.num_experts": 100}, "num_experts 100 is not divisible by ep 32"),
    ("topk-gt-experts", TINY, {"model.topk": 32}, "model.topk: 32 exceeds model.num_experts 16"),
    ("all-dense", TINY, {"model.first_k_dense_replace": 3}, "first_k_dense_replace: 3 leaves no MoE layer"),
    ("dup-group", SEED, {"engine_groups.1": "COPY0", "cluster.nodes": 64}, "duplicate group name 'main'"),
    ("too-many-gpus", TINY, {"engine_groups.0.engines": 3}, "12 GPUs requested but cluster has 1x4 = 4"),
    ("megatron-cp", SEED, {"megatron.cp": 3}, "world size 128 is not divisible by tp*pp*cp = 96"),
    ("megatron-ep", SEED, {"megatron.ep": 7}, "megatron.ep: ep*etp 7 does not divide the per-stage world size 32"),
    ("megatron-ep-experts", TINY, {"megatron": {"ep": 3, "actor_num_gpus_per_node": 3}},
     "megatron.ep: num_experts 16 is not divisible by ep 3"),
    ("megatron-sp-tp1", SEED, {"megatron.tp": 1}, "sequence_parallel: needs tp > 1"),
    ("spec-algorithm", TINY, {"engine_groups.0.speculative.algorithm": "MEDUSA"}, "'MEDUSA' is not one of"),
    ("spec-topk1-draft", SEED, {"engine_groups.0.speculative.num_draft_tokens": 5},
     "with eagle_topk 1 SGLang uses num_steps+1 = 4, got 5"),
    ("spec-tree-too-small", SEED, {"engine_groups.0.speculative.eagle_topk": 2,
                                   "engine_groups.0.speculative.num_steps": 2,
                                   "engine_groups.0.speculative.num_draft_tokens": 10}, "exceeds the draft tree"),
    ("r3-eagle-topk", SEED, {"engine_groups.0.speculative.eagle_topk": 2},
     "engine_groups[0].speculative.eagle_topk: 2 with routed experts: SGLang's capture rows do not follow"),
    ("r3-eagle-topk-extra", R3, {"engine_groups.0.extra_sglang_args": {
        "speculative_algorithm": "NEXTN", "speculative_num_steps": 2, "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 4}},
     "engine_groups[0].extra_sglang_args.speculative_eagle_topk: 2 with routed experts: SGLang's capture rows"),
    ("r3-ngram-extra", R3, {"engine_groups.0.extra_sglang_args": {"speculative_algorithm": "NGRAM"}},
     "engine_groups[0].extra_sglang_args.speculative_algorithm: NGRAM with routed experts"),
    ("eagle-no-mtp", SEED, {"model.num_nextn_predict_layers": 0}, "num_nextn_predict_layers is 0"),
    ("eagle3-no-draft", SEED, {"engine_groups.0.speculative.algorithm": "EAGLE3"}, "EAGLE3 needs a draft model"),
    ("standalone-dp-attn", SEED, {"engine_groups.0.speculative.algorithm": "STANDALONE",
                                  "engine_groups.0.speculative.draft_model_path": "x/y"},
     "STANDALONE speculative decoding does not support DP attention"),
    ("heads-vs-attn-tp", SEED, {"model.num_attention_heads": 100}, "num_attention_heads 100 is not divisible"),
    ("mem-fraction", SEED, {"engine_groups.0.mem_fraction_static": 1.5}, "mem_fraction_static: must be <= 0.99"),
    ("top-p", SEED, {"rollout.sampling.top_p": 2}, "rollout.sampling.top_p: must be <= 1.0"),
    ("budget-negative", SEED, {"rollout.budgets.process_s": -1}, "rollout.budgets.process_s: must be >= 0.1"),
    ("health-failures-0", SEED, {"rollout.health.failures": 0}, "rollout.health.failures: must be >= 1"),
    ("extra-arg-dashes", TINY, {"engine_groups.0.extra_sglang_args.attention-backend": "x"},
     "use the ServerArgs field name"),
    ("extra-arg-duplicate", TINY, {"engine_groups.0.extra_sglang_args.tp_size": 2}, "duplicates a typed field"),
    ("expected-unknown", SEED, {"engine_groups.0.expected.attn_size": 8}, "expected.attn_size: unknown fact"),
    ("deepep-ep-ne-tp", SEED, {"engine_groups.0.moe_a2a_backend": "deepep", "engine_groups.0.ep": 16},
     "deepep needs ep == tp"),
    ("a2a-without-ep", TINY, {"engine_groups.0.moe_a2a_backend": "mooncake", "engine_groups.0.ep": 1},
     "needs expert parallelism"),
    ("r3-with-pp", SEED, {"engine_groups.0.pp": 2, "engine_groups.0.tp": 16, "engine_groups.0.ep": 16},
     "routed_experts: routed-expert capture with pp > 1"),
    ("device-tpu", TINY, {"cluster.device": "tpu"}, "cluster.device: 'tpu' is not one of"),
    ("port-range", TINY, {"rollout.base_port": 70000}, "rollout.base_port: must be <= 65000"),
    ("build-unknown", TINY, {"model.build": "big"}, "model.build: 'big' is not one of"),
    ("tp-bool", TINY, {"engine_groups.0.tp": True}, "engine_groups[0].tp: expected an integer, got True"),
    ("env-list", TINY, {"engine_groups.0.env": {"X": [1]}}, "env.X: expected a string"),
    ("batch-zero", TINY, {"rollout.batch_size": 0}, "rollout.batch_size: must be >= 1"),
    ("managed-group-name-empty", TINY, {"engine_groups.0.name": ""}, "name: must not be empty"),
]


def _write_case(tmp_path, base, changes):
    data = _raw(base)
    for path, value in changes.items():
        if value == "COPY0":
            data["engine_groups"].append(copy.deepcopy(data["engine_groups"][0]))
            continue
        _set(data, path, value)
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc, err, needle):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]


@pytest.mark.parametrize("case_id,base,changes,needle", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_config_exits_2_with_one_line(tmp_path, capsys, case_id, base, changes, needle):
    f = _write_case(tmp_path, base, changes)
    rc, _, err = _run(capsys, ["config", "check", str(f), "--no-sglang"])
    _assert_one_line_error(rc, err, needle)


@pytest.mark.parametrize("text,needle", [
    ("model: [1, 2\n", "invalid YAML at line"),
    ("", "file is empty"),
    ("- 1\n- 2\n", "top level: expected a mapping"),
], ids=["yaml-syntax", "empty", "top-level-list"])
def test_unparseable_files(tmp_path, capsys, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    rc, _, err = _run(capsys, ["config", "check", str(f), "--no-sglang"])
    _assert_one_line_error(rc, err, needle)


def test_missing_file(tmp_path, capsys):
    rc, _, err = _run(capsys, ["config", "check", str(tmp_path / "nope.yaml")])
    _assert_one_line_error(rc, err, "cannot read")


def test_shipped_configs_pass_without_sglang(capsys):
    paths = shipped_configs()
    assert {os.path.basename(p) for p in paths} >= {"glm4.5-355b-a32b.yaml", "glm4.5-air-106b-a12b.yaml",
                                                    "tiny-cpu.yaml"}
    for p in paths:
        rc, out, err = _run(capsys, ["config", "check", p, "--no-sglang"])
        assert rc == 0, err
        assert ": OK" in out


# --------------------------------------------------------------------- with the installed SGLang

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang not installed")


@needs_sglang
def test_shipped_configs_pass_with_sglang():
    from training_configs.check import check_file
    for p in shipped_configs():
        rep = check_file(p)
        for g in rep.groups:
            assert g.derived.source.startswith("sglang ")
            names = {v.fix.name for v in g.fixes}
            assert g.fixes, "fixes_for_config returned nothing"
            assert all(isinstance(v.state, FixState) and v.needed in (True, False) for v in g.fixes)
        if rep.config.name == "glm4.5-355b-a32b":
            d = rep.groups[0].derived
            assert (d.attn_tp_size, d.require_mlp_tp_gather, d.require_attn_tp_gather) == (8, True, True)
            # the config states require_mlp_tp_gather False: SGLang disagrees with a2a "none"
            assert any("require_mlp_tp_gather = False" in w and "deepep" in w for w in rep.warnings), rep.warnings
            needed = {v.fix.name for v in rep.groups[0].fixes if v.needed}
            assert "capturer-extent" in needed and "draft-extend-real-rows" in needed, names


@needs_sglang
def test_seed_with_deepep_matches_the_stated_values(tmp_path):
    from training_configs.check import check_file
    data = _raw(SEED)
    data["engine_groups"][0]["moe_a2a_backend"] = "deepep"
    f = tmp_path / "seed-deepep.yaml"
    f.write_text(yaml.safe_dump(data))
    rep = check_file(f)
    assert rep.groups[0].derived.require_mlp_tp_gather is False
    assert not any("states" in w for w in rep.warnings), rep.warnings


@needs_sglang
@pytest.mark.parametrize("changes,needle", [
    ({"engine_groups.0.extra_sglang_args.attention_backend": "bogus"}, "argument --attention-backend: invalid choice"),
    ({"engine_groups.0.extra_sglang_args.not_a_field": 1}, "unrecognized arguments: --not-a-field"),
], ids=["bad-choice", "unknown-server-arg"])
def test_sglang_parser_rejections_exit_2(tmp_path, capsys, changes, needle):
    f = _write_case(tmp_path, TINY, changes)
    rc, _, err = _run(capsys, ["config", "check", str(f)])
    _assert_one_line_error(rc, err, needle)


@needs_sglang
def test_json_report(capsys):
    import json
    rc, out, _ = _run(capsys, ["config", "check", SEED, "--json"])
    assert rc == 0
    rep = json.loads(out)
    assert rep["groups"][0]["attn_tp_size"] == 8 and rep["ok"] is True


def test_schema_loads_what_the_manager_needs():
    cfg = load_config(os.path.join(HERE, "training_configs", "tiny-cpu.yaml"))
    g = cfg.engine_groups[0]
    assert cfg.model.build == "tiny-glm45" and cfg.cluster.device == "cpu"
    assert g.engines == 2 and g.routed_experts and g.env == {}   # the CPU device profile sets the engine env
    assert cfg.rollout.budgets.total_s > 0 and cfg.rollout.health.failures >= 1


def test_config_schema_accepts_the_shipped_configs_and_names_a_bad_field(capsys):
    """`config schema` is a JSON schema an editor can check a file with: every shipped config passes it; a
    string where an integer belongs and an unknown key fail it, at the field `config check` names."""
    import json

    import jsonschema

    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    for path in shipped_configs():
        jsonschema.validate(_raw(path), schema)
    bad = _raw(TINY)
    bad["engine_groups"][0]["tp"] = "two"
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.validate(bad, schema)
    assert list(e.value.absolute_path) == ["engine_groups", 0, "tp"]
    bad = _raw(TINY)
    bad["rollout"]["bse_port"] = 30000
    with pytest.raises(jsonschema.ValidationError, match="'bse_port' was unexpected"):
        jsonschema.validate(bad, schema)
