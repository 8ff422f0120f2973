"""`engine plan`: every node's command for the GPU configs parses with SGLang's own parser (every
reviewed version found here) into the ServerArgs slime's `_compute_server_args` derives for the same job.

The expected values are facts read from slime (THUDM/slime 624b824,
slime/backends/sglang_utils/sglang_engine.py `_compute_server_args` and slime/ray/rollout.py
`_allocate_rollout_engine_addr_and_ports_normal`, with the seed script's flags
scripts/run-glm4.7-355B-A32B.sh: --rollout-num-gpus-per-engine 32, --sglang-mem-fraction-static 0.7,
--sglang-enable-dp-attention, --sglang-dp-size 4, --sglang-ep-size 32, --sglang-enable-dp-lm-head,
--sglang-moe-dense-tp-size 1, EAGLE 3/1/4, 4 GPUs per node, colocated):
  nnodes = max(1, gpus_per_engine // num_gpus_per_node); node_rank = rank % nnodes;
  tp_size = gpus_per_engine // pp_size; dp/ep/pp from --sglang-*; gpu_id_step = 1;
  base_gpu_id = (rank * min(gpus_per_node, gpus_per_engine)) % gpus_per_node (0 for whole nodes);
  dist_init_addr = node 0's "addr:port", the same for every node of one engine;
  enable_return_routed_experts = True with --use-rollout-routing-replay; the rest from --sglang-*.
Interpreters: this one (0.5.23), plus SMR_SGLANG_PYTHONS (':'-separated) and .venvs/sglang-*/bin/python.
"""
import functools
import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

from rollout import config as rconfig
from rollout.cli import main
from rollout.engines.command import plan
from rollout.engines.process import write_secret_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARSE = os.path.join(ROOT, "tests", "sglang_parse.py")
PYTHONS = [sys.executable] + [p for p in os.environ.get("SMR_SGLANG_PYTHONS", "").split(":") if p] + \
    sorted(glob.glob(os.path.join(ROOT, ".venvs", "sglang-*", "bin", "python")))

SLIME = {  # literal facts of slime's derivation for the same job (see the module docstring)
    "glm4.5-355b-a32b.yaml": dict(
        engines=4, nnodes=8, tp_size=32, dp_size=4, ep_size=32, pp_size=1, base_gpu_id=0, gpu_id_step=1,
        enable_dp_attention=True, enable_dp_lm_head=True, moe_dense_tp_size=1, speculative_algorithm="EAGLE",
        speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
        enable_return_routed_experts=True, mem_fraction_static=0.7),
    "glm4.5-air-106b-a12b.yaml": dict(  # 8 GPUs per engine = one 8-GPU node: nnodes 1, node_rank 0
        engines=4, nnodes=1, tp_size=8, dp_size=2, ep_size=8, pp_size=1, base_gpu_id=0, gpu_id_step=1,
        enable_dp_attention=True, enable_dp_lm_head=True, moe_dense_tp_size=1, speculative_algorithm="EAGLE",
        speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
        enable_return_routed_experts=True, mem_fraction_static=0.7),
}
FIELDS = sorted({k for v in SLIME.values() for k in v if k != "engines"} |
                {"node_rank", "dist_init_addr", "device", "host", "port", "nccl_port", "api_key",
                 "sleep_on_idle", "max_total_tokens", "attention_backend"})
CPU_ENV = ("SGLANG_USE_CPU_ENGINE", "SGLANG_CPU_OMP_THREADS_BIND")


def _plans():
    out = {}
    for name in SLIME:
        cfg = rconfig.load(os.path.join(ROOT, "training_configs", name))
        hosts = [f"10.0.0.{i}" for i in range(cfg.cluster.nodes)]
        out[name] = (cfg, hosts, plan(cfg, hosts=hosts))
    return out


def _parse(python, argvs):
    r = subprocess.run([python, PARSE], input=json.dumps({"argvs": argvs, "fields": FIELDS}),
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=None)
def _inputs():
    """(plans, argvs to parse, the 0600 key file, the CPU command): the same for every interpreter."""
    plans = _plans()
    argvs = [c.argv[3:] for _, _, engines in plans.values() for cmds in engines for c in cmds]
    key_file = write_secret_config(os.path.join(tempfile.mkdtemp(prefix="plan-key-"), "k.yaml"), "s3cret-key")
    cpu = rconfig.load(os.path.join(ROOT, "training_configs", "tiny-cpu-dpattn.yaml"))
    (cpu_cmd,), = plan(cpu)
    return plans, argvs + [argvs[0] + ["--config", key_file], cpu_cmd.argv[3:]], key_file, cpu_cmd


def _parsed_by(python):
    return _parse(python, _inputs()[1])


@pytest.fixture(scope="module", params=PYTHONS, ids=lambda p: "main" if p == sys.executable else p.strip("/").replace("/", "_")[-48:])
def parsed(request):
    from support.variant_runs import ahead

    plans, _, key_file, cpu_cmd = _inputs()
    res = ahead("plan-parse", _parsed_by, request.param, PYTHONS)   # the next interpreter parses meanwhile
    it = iter(res["parsed"])
    by_config = {name: [[next(it) for _ in cmds] for cmds in engines] for name, (_, _, engines) in plans.items()}
    return res["version"], plans, by_config, next(it), key_file, (cpu_cmd, next(it))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SLIME))
def test_gpu_plan_parses_into_slimes_server_args(parsed, name):
    version, plans, by_config = parsed[:3]
    cfg, hosts, engines = plans[name]
    facts = dict(SLIME[name])
    assert len(engines) == facts.pop("engines")
    nnodes = facts["nnodes"]
    for e, (cmds, got) in enumerate(zip(engines, by_config[name])):
        assert len(cmds) == nnodes
        port = cfg.rollout.base_port + 10 * e
        for r, (c, ns) in enumerate(zip(cmds, got)):
            want = dict(facts, node_rank=r, dist_init_addr=f"{hosts[e * nnodes]}:{port + 2}", device="cuda",
                        host=hosts[e * nnodes + r], nccl_port=port + 1, api_key=None,
                        sleep_on_idle=False, max_total_tokens=None, attention_backend=None)
            assert {k: ns[k] for k in want} == want, f"SGLang {version}: engine {e} node {r}"
            assert ns["port"] == (port if r == 0 else port + 9)
            assert not [a for a in c.argv if "cpu" in a.lower()], c.argv
            assert set(c.env) == {"PYTHONUNBUFFERED"} and not set(CPU_ENV) & set(c.env)


@pytest.mark.timeout(300)
def test_api_key_reaches_sglang_through_a_0600_config_file(parsed):
    version, plans, _, with_key, key_file, _ = parsed
    assert with_key["api_key"] == "s3cret-key", f"SGLang {version} did not merge --config"
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    assert all("--api-key" not in c.argv for _, _, e in plans.values() for cmds in e for c in cmds)


@pytest.mark.timeout(300)
def test_cpu_profile_only_on_cpu(parsed):
    version, (c, ns) = parsed[0], parsed[-1]
    assert ns["device"] == "cpu", version
    assert ns["device"] == "cpu" and ns["sleep_on_idle"] is True and ns["max_total_tokens"] == 4096
    assert ns["attention_backend"] == "intel_amx" and c.env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_plan_cli_prints_every_node_and_no_key(capsys):
    cfg = os.path.join(ROOT, "training_configs", "glm4.5-355b-a32b.yaml")
    assert main(["engine", "plan", "--config", cfg]) == 0
    out = capsys.readouterr().out
    cmds = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert len(cmds) == 32 and all("--node-rank" in ln and "--device cuda" in ln for ln in cmds)
    assert "--api-key" not in out and "SGLANG_USE_CPU_ENGINE" not in out
    assert main(["engine", "plan", "--config", cfg, "--hosts", "a,b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --hosts: 2 address(es) given, cluster.nodes is 32"]
