"""The one command builder: an engine (a config group's `EngineSpec`) -> per-node `NodeCommand`s
(argv, env). It holds the one mapping from an engine group to SGLang ServerArgs fields
(`training_configs.server_args`), which `config render` prints and checks too. Nothing is started here.

Device profiles:
  cpu  : --device cpu, SGLANG_USE_CPU_ENGINE=1, OMP thread binding split over the ranks, a small token
         pool (4096) and memory fraction (0.05) unless set, intel_amx with speculative decoding,
         --sleep-on-idle (an idle CPU scheduler otherwise busy-polls a whole core).
  cuda : --device cuda, the config's memory fraction and cuda-graph settings as given, --nccl-port,
         --dist-init-addr, --base-gpu-id / --gpu-id-step from the placement; no CPU-only flag or env.
An engine with gpus_per_engine > gpus_per_node spans nnodes = gpus_per_engine // gpus_per_node nodes
(as slime's `_compute_server_args` derives): every node gets the same flags plus --nnodes, --node-rank
and node 0's --dist-init-addr; node 0 serves HTTP.

Ports of an engine at `port` (`training_configs.server_args.engine_port`: engines are PORTS_PER_ENGINE apart): port
HTTP, port+1 NCCL, port+2 dist-init (SGLang derives port+3.. from it), port+9 the health stub SGLang
binds on nodes 1.. (apart from node 0's HTTP port when nodes share a host, as in the CPU simulation).
The API key never goes on argv: `api_key` is written by the spawner to a 0600 file passed with --config.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from training_configs.server_args import fields_to_flags, group_fields

NCCL_PORT, DIST_PORT, STUB_PORT = 1, 2, 9
CPU_TOKENS, CPU_MEM_FRACTION = 4096, 0.05


@dataclass
class Layout:
    """Where one node of an engine runs."""
    nnodes: int = 1
    node_rank: int = 0
    hosts: list = field(default_factory=list)   # address of every node of the engine, node 0 first
    gpus: list = field(default_factory=list)    # local GPU ids of this node (cuda)


@dataclass
class NodeCommand:
    engine: str
    node_rank: int
    nnodes: int
    host: str
    port: int
    argv: list
    env: dict          # only what the engine needs; the spawner adds the node's own environment
    api_key: Optional[str] = None  # goes to a 0600 --config file, never on argv

    def shell(self) -> str:
        import shlex
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cfg = " --config <0600 file with api-key>" if self.api_key else ""
        return f"{env} {shlex.join(self.argv)}{cfg}".strip()


def rank_count(fields: dict) -> int:
    """Scheduler processes SGLang starts: DP attention puts the dp ranks inside tp."""
    tp, dp = int(fields.get("tp_size", 1)), int(fields.get("dp_size", 1) or 1)
    return tp * (int(fields.get("pp_size", 1) or 1)) * (1 if fields.get("enable_dp_attention") else dp)


def thread_binding(ranks: int, cpus: Optional[list] = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value: the available CPUs split among ranks (shared when fewer)."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if ranks <= len(cpus):
        per = len(cpus) // ranks
        groups = [cpus[i * per : (i + 1) * per] for i in range(ranks)]
    else:
        groups = [[cpus[i % len(cpus)]] for i in range(ranks)]
    return "|".join(_cpu_range(g) for g in groups)


def _cpu_range(group: list) -> str:
    if len(group) > 1 and group == list(range(group[0], group[-1] + 1)):
        return f"{group[0]}-{group[-1]}"
    return ",".join(str(c) for c in group)


def build(name: str, fields: dict, *, device: str, port: int, api_key: Optional[str] = None,
          layout: Optional[Layout] = None, env: Optional[dict] = None, host: str = "127.0.0.1") -> NodeCommand:
    """NodeCommand for one node of an engine whose ServerArgs fields are `fields` (no host/port/key)."""
    lay = layout or Layout(hosts=[host])
    hosts = lay.hosts or [host]
    f = {k: v for k, v in fields.items() if k not in ("device", "host", "port", "api_key")}
    f["device"] = device
    f["host"] = hosts[lay.node_rank] if lay.node_rank < len(hosts) else host
    f["port"] = port if lay.node_rank == 0 else port + STUB_PORT
    f["skip_server_warmup"] = True
    user_env = {k: str(v) for k, v in (env or {}).items()}
    out_env = {"PYTHONUNBUFFERED": "1"}
    if lay.nnodes > 1 or device == "cuda":
        f["dist_init_addr"] = f"{hosts[0]}:{port + DIST_PORT}"
        f["nccl_port"] = port + NCCL_PORT
    if lay.nnodes > 1:
        f["nnodes"], f["node_rank"] = lay.nnodes, lay.node_rank
    if device == "cpu":
        f.setdefault("mem_fraction_static", CPU_MEM_FRACTION)
        f.setdefault("max_total_tokens", CPU_TOKENS)
        if f.get("speculative_algorithm") and not f.get("attention_backend"):
            f["attention_backend"] = "intel_amx"  # the only CPU backend with EAGLE draft/verify support
        f["sleep_on_idle"] = True
        out_env["SGLANG_USE_CPU_ENGINE"] = "1"
        ranks = rank_count(f)
        if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in user_env:
            per_node = max(1, ranks // lay.nnodes)
            groups = thread_binding(per_node * lay.nnodes).split("|")
            out_env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(groups[lay.node_rank * per_node:
                                                                     (lay.node_rank + 1) * per_node])
    elif lay.gpus:
        gpus = sorted(lay.gpus)
        if gpus == list(range(gpus[0], gpus[0] + len(gpus))):
            f["base_gpu_id"], f["gpu_id_step"] = gpus[0], 1
        else:  # not contiguous: make them 0.. with CUDA_VISIBLE_DEVICES
            out_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
            f["base_gpu_id"], f["gpu_id_step"] = 0, 1
    out_env.update(user_env)
    argv = [sys.executable, "-m", "sglang.launch_server"] + fields_to_flags(f)
    return NodeCommand(name, lay.node_rank, lay.nnodes, f["host"], int(f["port"]), argv, out_env, api_key)


def spec_fields(spec) -> dict:
    """ServerArgs fields of one engine of a config."""
    return group_fields(spec.group, spec.model_path, spec.tokenizer_path)


def spec_layouts(spec, hosts: Optional[list] = None, gpus: Optional[list] = None) -> list:
    """One Layout per node of the engine. Defaults (no placement known): every node on `spec.host`
    when `hosts` is None, and GPUs as slime places them (consecutive from the engine's offset)."""
    n = spec.nnodes
    hosts = list(hosts) if hosts else [spec.host] * n
    if len(hosts) != n:
        raise ValueError(f"engine {spec.name}: {n} node(s) but {len(hosts)} host(s) given")
    per_node = min(spec.group.gpus_per_engine, spec.gpus_per_node)
    if gpus is None:
        base = spec.gpu_offset % spec.gpus_per_node
        gpus = [list(range(base, base + per_node))] * n
    return [Layout(n, r, hosts, gpus[r] if spec.device == "cuda" else []) for r in range(n)]


def spec_commands(spec, hosts: Optional[list] = None, gpus: Optional[list] = None) -> list:
    """Every node's NodeCommand for one engine of a config (node 0 first)."""
    fields = spec_fields(spec)
    return [build(spec.name, fields, device=spec.device, port=spec.port, api_key=spec.api_key, layout=lay,
                  env=dict(spec.group.env), host=spec.host)
            for lay in spec_layouts(spec, hosts, gpus)]


def plan(cfg, model_path: Optional[str] = None, hosts: Optional[list] = None) -> list:
    """Every engine's per-node commands for a config, nothing started. `hosts`: the address of every
    cluster node (default `node-<i>` on cuda, rollout.host on cpu); engines take nodes in order."""
    from rollout.config import engine_specs

    c = cfg.cluster
    if hosts is None:
        hosts = [f"node-{i}" for i in range(c.nodes)] if c.device == "cuda" else [cfg.rollout.host] * c.nodes
    if len(hosts) != c.nodes:
        raise ValueError(f"--hosts: {len(hosts)} address(es) given, cluster.nodes is {c.nodes}")
    out = []
    for spec in engine_specs(cfg, model_path or cfg.model.path, api_key="(not shown)"):
        first = spec.gpu_offset // spec.gpus_per_node
        spec.host = hosts[first]
        out.append(spec_commands(spec, hosts[first:first + spec.nnodes]))
    return out
