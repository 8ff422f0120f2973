"""Managed mode (`serve` + slime's `--rollout-external-engine-addrs`) against slime's external-engine
rules, as FACTS read from THUDM/slime 624b824 (`sglang_engine.py`, `external.py`, `arguments.py`).
With slime importable and an SGLang whose ServerArgs is a dataclass (<= 0.5.15.post1), slime's own
`_compute_server_args` is run too."""
import dataclasses
import os
from types import SimpleNamespace

import pytest

from rollout.config import engine_specs
from training_configs.check import check_config
from training_configs.render import external_addrs, server_fields, slime_args
from training_configs.schema import ConfigError, load_config, shipped_configs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(HERE, "training_configs", "tiny-cpu.yaml")
BIG = os.path.join(HERE, "training_configs", "glm4.5-355b-a32b.yaml")

# slime's _EXTERNAL_ENGINE_SKIP_CHECK_FIELDS: never compared with /server_info.
SLIME_SKIPPED = {"model_path", "trust_remote_code", "random_seed", "host", "port", "nccl_port", "nnodes",
                 "node_rank", "dist_init_addr", "gpu_id_step", "base_gpu_id", "tp_size", "dp_size", "pp_size",
                 "ep_size", "skip_server_warmup", "enable_draft_weights_cpu_backup", "enable_metrics",
                 "mem_fraction_static"}
# ...and what it does compare for a regular worker: enable_memory_saver (= offload_rollout), plus
# enable_return_routed_experts with --use-rollout-routing-replay and dtype "float16" with --fp16.
SLIME_COMPARED_R3 = ["enable_memory_saver", "enable_return_routed_experts"]


def _managed(path, **rollout):
    cfg = load_config(path)
    cfg.slime.integration = "managed"
    cfg.rollout.engine_auth = "none"
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_rendered_addresses_are_the_managers_ports(path):
    cfg = load_config(path)
    specs = engine_specs(cfg, "/models/x", api_key="k")
    assert external_addrs(cfg) == [f"{s.host}:{s.port}" for s in specs]
    argv = slime_args(cfg, "managed")
    i = argv.index("--rollout-external-engine-addrs")
    assert argv[i + 1:i + 1 + len(specs)] == external_addrs(cfg)
    assert "--rollout-function-path" not in argv   # slime's own rollout (or ours) goes through its router


def test_managed_engines_are_keyless_and_keyed_ones_are_refused():
    cfg = load_config(TINY)
    assert cfg.slime.integration == "managed" and cfg.rollout.engine_auth == "none"
    assert {s.api_key for s in engine_specs(cfg, "/m")} == {""}      # slime sends no Authorization header
    cfg.rollout.engine_auth = "key"
    with pytest.raises(ConfigError, match="rollout.engine_auth: .* send no API key, so keyed engines answer 401"):
        check_config(cfg, use_sglang=False)


def test_wide_binds_are_loud():
    opt_in = {"allow_unauthenticated_network": True}     # else refused: tests/test_keyless_network.py
    warnings = check_config(_managed(TINY, host="0.0.0.0", **opt_in), use_sglang=False).warnings
    assert any("listen on EVERY interface" in w for w in warnings)
    warnings = check_config(_managed(TINY, host="10.1.2.3", **opt_in), use_sglang=False).warnings
    assert any("accept any client that can reach 10.1.2.3" in w for w in warnings)
    assert not any("rollout.host" in w for w in check_config(_managed(TINY), use_sglang=False).warnings)


def test_compared_fields_are_checked():
    cfg = _managed(TINY)
    cfg.slime.extra_args = {"offload-rollout": True}
    with pytest.raises(ConfigError, match=r"enable_memory_saver \(False\) with its offload_rollout \(True\)"):
        check_config(cfg, use_sglang=False)
    cfg.slime.extra_args = {"fp16": True}
    with pytest.raises(ConfigError, match="--fp16 expects engines with dtype float16"):
        check_config(cfg, use_sglang=False)
    cfg.engine_groups[0].extra_sglang_args["dtype"] = "float16"
    check_config(cfg, use_sglang=False)
    cfg.slime.extra_args = {"use-rollout-routing-replay": True}
    cfg.engine_groups[0].routed_experts = False
    with pytest.raises(ConfigError, match="expects enable_return_routed_experts"):
        check_config(cfg, use_sglang=False)


def _node_rank(rank, gpus_per_engine, num_gpus_per_node):
    """slime's _compute_server_args: nnodes = max(1, gpus // num_gpus_per_node); node_rank = rank % nnodes."""
    return rank % max(1, gpus_per_engine // num_gpus_per_node)


def test_multi_node_engines_all_get_node_rank_zero():
    """32-GPU engines on 4-GPU nodes: with slime's default rule engine 1 would be node_rank 1 (never
    registered, no weight updates); the rendered --num-gpus-per-node makes every address node_rank 0."""
    cfg = _managed(BIG)
    g = cfg.engine_groups[0]
    assert (g.gpus_per_engine, cfg.cluster.gpus_per_node) == (32, 4)
    assert _node_rank(1, 32, cfg.cluster.gpus_per_node) == 1
    argv = slime_args(cfg, "managed")
    n = int(argv[argv.index("--num-gpus-per-node") + 1])
    assert n == 32 and all(_node_rank(r, 32, n) == 0 for r in range(g.engines))
    argv = slime_args(load_config(BIG), "plugin")
    assert argv[argv.index("--num-gpus-per-node") + 1] == "4"   # slime launches: the real node width


def test_slimes_own_server_args_rule(monkeypatch):
    try:
        from sglang.srt.server_args import ServerArgs
        from slime.backends.sglang_utils.sglang_engine import _compute_server_args
    except ImportError as e:
        pytest.skip(f"slime not importable: {e}")
    if not dataclasses.is_dataclass(ServerArgs):
        pytest.skip("slime's _compute_server_args needs SGLang's dataclass ServerArgs (<= 0.5.15.post1)")
    import slime.backends.sglang_utils.sglang_engine as engine_mod
    # FAKE of slime's GPU-id mapping only (it needs a CUDA device); base_gpu_id is in the skipped fields
    monkeypatch.setattr(engine_mod.accelerator, "resolve_visible_device_id", int)
    cfg = _managed(BIG)
    argv = slime_args(cfg, "managed")
    n = int(argv[argv.index("--num-gpus-per-node") + 1])
    args = SimpleNamespace(rollout_num_gpus_per_engine=32, sglang_pp_size=1, num_gpus_per_node=n, seed=1,
                           hf_checkpoint="/m", offload_rollout=False, sglang_dp_size=1, sglang_ep_size=1,
                           use_rollout_routing_replay=True, fp16=False, colocate=False,
                           actor_num_nodes=1, actor_num_gpus_per_node=4)
    for rank in range(cfg.engine_groups[0].engines):
        kw, compared = _compute_server_args(args, rank, "h:1", None, "h", 1000 + rank, base_gpu_id=0,
                                            num_gpus_per_engine=32)
        assert kw["node_rank"] == 0 and kw["nnodes"] == 1 and compared == SLIME_COMPARED_R3
        assert not SLIME_SKIPPED & set(compared)
    fields = server_fields(cfg, cfg.engine_groups[0])
    assert fields.get("enable_memory_saver", False) is False and fields["enable_return_routed_experts"] is True
