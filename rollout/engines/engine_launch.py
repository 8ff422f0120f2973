"""The engine issue's presets (a), (b), (c) on CPU: options, a process handle, log parsers.

`server_command(opts)` builds (argv, env) with the one command builder (`rollout.engines.command`);
`launch(opts, log_path)` starts it with the one spawner (`rollout.engines.process.ServerProcess`) and
returns an `EngineProcess`, whose `stop()` ends the whole process tree (checked by PID, no orphans).
"""
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from rollout.engines import command as cmd
from rollout.engines.process import ServerProcess

PLUGIN_LINE = "slime-moe-rollout plugin: active fixes:"


@dataclass
class EngineOptions:
    model_path: str
    tp: int = 1
    dp: int = 1
    ep: int = 1
    moe_dense_tp: Optional[int] = None
    enable_dp_attention: bool = False
    enable_dp_lm_head: bool = False
    speculative: Optional[dict] = None  # {"algorithm","num_steps","eagle_topk","num_draft_tokens"}
    routed_experts: bool = False
    host: str = "127.0.0.1"
    port: Optional[int] = None  # None -> a free port
    api_key: Optional[str] = None  # None -> generated; "" -> no key (slime's managed mode)
    attention_backend: Optional[str] = None  # None -> intel_amx with speculative decoding, else SGLang's choice
    mem_fraction_static: float = 0.05
    max_total_tokens: int = 4096
    extra_args: list = field(default_factory=list)
    env: dict = field(default_factory=dict)


SPEC_KEYS = ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens")


MAX_PORT = 65535 - 10000  # SGLang 0.5.15.post1 derives its gRPC port as port + 10000 and refuses one above 65535


def free_port(host: str = "127.0.0.1") -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port <= MAX_PORT:
            return port


def resolve(opts: EngineOptions) -> EngineOptions:
    """Fill in the port and API key when they are left to us; check the rest."""
    for name in ("tp", "dp", "ep"):
        if int(getattr(opts, name)) < 1:
            raise ValueError(f"engine option {name} must be >= 1, got {getattr(opts, name)}")
    if opts.enable_dp_attention and opts.tp % opts.dp:
        raise ValueError(f"DP attention needs tp divisible by dp (tp={opts.tp}, dp={opts.dp})")
    if opts.speculative is not None:
        missing = [k for k in SPEC_KEYS if k not in opts.speculative]
        if missing:
            raise ValueError(f"speculative options lack {', '.join(missing)}")
    return replace(
        opts,
        port=opts.port or free_port(opts.host),
        api_key=secrets.token_hex(16) if opts.api_key is None else opts.api_key,
    )


def options_fields(opts: EngineOptions) -> dict:
    """ServerArgs fields of preset options (host, port and key are added by the builder)."""
    f = {"model_path": opts.model_path, "tp_size": opts.tp, "dp_size": opts.dp,
         "mem_fraction_static": opts.mem_fraction_static, "max_total_tokens": opts.max_total_tokens}
    if opts.ep > 1:
        f["ep_size"] = opts.ep
    if opts.moe_dense_tp is not None:
        f["moe_dense_tp_size"] = opts.moe_dense_tp
    f["enable_dp_attention"] = opts.enable_dp_attention
    f["enable_dp_lm_head"] = opts.enable_dp_lm_head
    f["enable_return_routed_experts"] = opts.routed_experts
    if opts.speculative is not None:
        s = opts.speculative
        f.update(speculative_algorithm=s["algorithm"], speculative_num_steps=s["num_steps"],
                 speculative_eagle_topk=s["eagle_topk"], speculative_num_draft_tokens=s["num_draft_tokens"])
    if opts.attention_backend:
        f["attention_backend"] = opts.attention_backend
    return f


def rank_count(opts: EngineOptions) -> int:
    return cmd.rank_count(options_fields(opts))


thread_binding = cmd.thread_binding


def node_command(opts: EngineOptions) -> cmd.NodeCommand:
    opts = resolve(opts)
    return cmd.build("preset", options_fields(opts), device="cpu", port=opts.port, api_key=opts.api_key,
                     extra_flags=opts.extra_args, env=opts.env, host=opts.host)


def server_command(opts: EngineOptions) -> tuple:
    """(argv, env) for `python -m sglang.launch_server` on CPU; the API key is not on argv."""
    c = node_command(opts)
    return c.argv, c.env


@dataclass
class EngineProcess:
    proc: ServerProcess
    opts: EngineOptions
    log_path: str
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.port}"

    @property
    def api_key(self) -> str:
        return self.opts.api_key

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def alive(self) -> bool:
        return self.proc.alive()

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        text = self.log_text()
        return "\n".join((text.replace(self.api_key, "***") if self.api_key else text).splitlines()[-n:])

    def tree_pids(self) -> list:
        return self.proc.tree_pids()

    def wait_ready(self, budget_s: float = 300.0, on_tick: Optional[Callable[[float], None]] = None) -> float:
        """Wait until `/health` answers 200; returns seconds since launch. Raises on exit or timeout."""
        import requests

        deadline = self.started_at + budget_s
        while True:
            if not self.alive():
                raise RuntimeError(f"engine exited with {self.proc.returncode()} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                r = requests.get(self.url + "/health", headers=self.headers(), timeout=5)
                if r.status_code == 200:
                    return time.time() - self.started_at
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"engine not ready after {budget_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")
            if on_tick:
                on_tick(time.time() - self.started_at)
            time.sleep(1.0)

    def stop(self, timeout: float = 30.0) -> list:
        """Stop the whole process tree (no orphans); returns PIDs still alive."""
        return self.proc.stop(grace_s=timeout)

    def memory(self) -> dict:
        """RSS in bytes per process of the tree: {pid: (name, rss)}."""
        import psutil

        out = {}
        for pid in self.tree_pids():
            try:
                p = psutil.Process(pid)
                out[pid] = (_proc_name(p), p.memory_info().rss)
            except psutil.NoSuchProcess:
                pass
        return out

    def startup_timings(self) -> Optional[dict]:
        return parse_startup_timings(self.log_text())

    def active_fixes(self) -> Optional[list]:
        """Fix names from the plugin's log line (the first one seen), or None if never logged."""
        return parse_active_fixes(self.log_text())


def _proc_name(p) -> str:
    try:
        cmd = p.cmdline()
    except Exception:
        cmd = []
    name = p.name()
    if name.startswith("sglang::"):
        return name
    joined = " ".join(cmd)
    if "sglang.launch_server" in joined:
        return "launch_server"
    if "resource_tracker" in joined:
        return "resource_tracker"
    return name


_TIMINGS = re.compile(
    r"Engine startup timings \(s\): load_weight=([\d.]+), kv_cache_allocation=([\d.]+), "
    r"scheduler_e2e=([\d.]+), cuda_graph=\{([^}]*)\}, tokenizer_e2e=([\d.]+)"
)


def parse_startup_timings(text: str) -> Optional[dict]:
    m = _TIMINGS.search(text)
    if not m:
        return None
    return {
        "load_weight": float(m.group(1)),
        "kv_cache_allocation": float(m.group(2)),
        "scheduler_e2e": float(m.group(3)),
        "tokenizer_e2e": float(m.group(5)),
    }


def parse_active_fixes(text: str) -> Optional[list]:
    for line in text.splitlines():
        if PLUGIN_LINE in line:
            rest = line.split(PLUGIN_LINE, 1)[1].strip()
            return [] if rest == "none" else [x.strip() for x in rest.split(",") if x.strip()]
    return None


def launch(opts: EngineOptions, log_path: str) -> EngineProcess:
    """Start the server in its own session, stdout+stderr to `log_path`."""
    opts = resolve(opts)
    c = node_command(opts)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    open(log_path, "w").close()  # a fresh log: the parsers read the first matching line
    return EngineProcess(proc=ServerProcess(c.argv, c.env, log_path, api_key=c.api_key, owner_port=opts.port),
                         opts=opts, log_path=log_path)


NEXTN = {"algorithm": "NEXTN", "num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}
PRESETS = {
    "a": "single rank + routed experts",
    "b": "single rank + routed experts + NEXTN (2 steps, top-k 1, 3 draft tokens)",
    "c": "DP attention tp 4 / dp 2 (attn_tp 2), ep 4, moe-dense-tp 1, dp-lm-head, NEXTN, routed experts",
}


def preset(name: str, model_path: str, **overrides) -> EngineOptions:
    """The issue's configurations (a), (b), (c) for `model_path`."""
    if name == "a":
        opts = EngineOptions(model_path=model_path, routed_experts=True)
    elif name == "b":
        opts = EngineOptions(model_path=model_path, routed_experts=True, speculative=dict(NEXTN))
    elif name == "c":
        opts = EngineOptions(model_path=model_path, tp=4, dp=2, ep=4, moe_dense_tp=1, enable_dp_attention=True,
                             enable_dp_lm_head=True, routed_experts=True, speculative=dict(NEXTN))
    else:
        raise ValueError(f"unknown engine configuration {name!r} (choose from {', '.join(PRESETS)})")
    return replace(opts, **overrides)
