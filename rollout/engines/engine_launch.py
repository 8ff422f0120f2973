"""Launch real SGLang on CPU: argv and env for a configuration, a process handle, a clean stop.

`server_command(opts)` builds the argv (never a shell string) and the full environment;
`launch(opts, log_path)` starts it in its own session and returns an `EngineProcess`, whose
`stop()` ends the whole process tree (checked by PID, no orphans).
"""
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def rank_count(opts: EngineOptions) -> int:
    """Scheduler processes SGLang starts: DP attention puts the dp ranks inside tp."""
    return opts.tp if opts.enable_dp_attention else opts.tp * opts.dp


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


def server_command(opts: EngineOptions) -> tuple:
    """(argv, env) for `python -m sglang.launch_server` on CPU."""
    opts = resolve(opts)
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", opts.model_path,
        "--device", "cpu",
        "--host", opts.host,
        "--port", str(opts.port),
        *(["--api-key", opts.api_key] if opts.api_key else []),
        "--tp-size", str(opts.tp),
        "--dp-size", str(opts.dp),
        "--mem-fraction-static", str(opts.mem_fraction_static),
        "--max-total-tokens", str(opts.max_total_tokens),
        "--skip-server-warmup",
    ]
    if opts.ep > 1:
        argv += ["--ep-size", str(opts.ep)]
    if opts.moe_dense_tp is not None:
        argv += ["--moe-dense-tp-size", str(opts.moe_dense_tp)]
    if opts.enable_dp_attention:
        argv.append("--enable-dp-attention")
    if opts.enable_dp_lm_head:
        argv.append("--enable-dp-lm-head")
    if opts.routed_experts:
        argv.append("--enable-return-routed-experts")
    backend = opts.attention_backend
    if opts.speculative is not None:
        s = opts.speculative
        argv += [
            "--speculative-algorithm", str(s["algorithm"]),
            "--speculative-num-steps", str(s["num_steps"]),
            "--speculative-eagle-topk", str(s["eagle_topk"]),
            "--speculative-num-draft-tokens", str(s["num_draft_tokens"]),
        ]
        backend = backend or "intel_amx"  # the only CPU backend with EAGLE draft/verify support
    if backend:
        argv += ["--attention-backend", backend]
    argv += [str(a) for a in opts.extra_args]

    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    ranks = rank_count(opts)
    if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in opts.env:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = thread_binding(ranks)
    env.update({k: str(v) for k, v in opts.env.items()})
    return argv, env


@dataclass
class EngineProcess:
    popen: subprocess.Popen
    opts: EngineOptions
    log_path: str
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.port}"

    @property
    def api_key(self) -> str:
        return self.opts.api_key

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def tree_pids(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.pid)
            return [self.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def wait_ready(self, budget_s: float = 300.0, on_tick: Optional[Callable[[float], None]] = None) -> float:
        """Wait until `/health` answers 200; returns seconds since launch. Raises on exit or timeout."""
        import requests

        deadline = self.started_at + budget_s
        while True:
            if not self.alive():
                raise RuntimeError(f"engine exited with {self.popen.returncode} before it was ready; "
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
        """SIGTERM the launcher, then SIGKILL whatever of its tree is left. Returns PIDs still alive."""
        import psutil

        procs = []
        for pid in self.tree_pids():
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        _, left = psutil.wait_procs(procs, timeout=timeout)
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, left = psutil.wait_procs(left, timeout=10)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._kill_session_leftovers()
        return [p.pid for p in left if _running(p)]

    def _kill_session_leftovers(self) -> None:
        """Anything still in the launcher's own session (re-parented helpers) is ours: kill it."""
        import psutil

        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid != os.getpid() and os.getsid(p.pid) == self.pid:
                    p.kill()
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass

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
    argv, env = server_command(opts)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    log = open(log_path, "w")
    try:
        popen = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()
    return EngineProcess(popen=popen, opts=opts, log_path=log_path)


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


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
