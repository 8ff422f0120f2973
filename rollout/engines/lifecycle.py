"""Engine lifecycle: start, watch and stop SGLang server processes. Two backends, one interface.

`LocalBackend` runs each engine as a child process on this machine (the CPU demo, one node);
`rollout.engines.ray_backend.RayBackend` runs each engine inside a Ray actor placed with a placement group.
Both return an `Engine` handle. The server command comes from `rollout.engines.engine_launch.server_command`
(an argv list, never a shell); tests may pass their own `command(spec) -> (argv, env)`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from typing import Callable, Optional

from rollout.config import EngineSpec

Command = Callable[[EngineSpec], "tuple[list[str], dict[str, str]]"]


class EngineStartError(RuntimeError):
    """The engine could not be launched at all (one line)."""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def default_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """argv + env for a real SGLang server, from the engine area's `server_command`."""
    from rollout.engines import engine_launch as el
    return el.server_command(engine_options(spec))


def engine_options(spec: EngineSpec):
    """Map one engine of a config group to engine_launch.EngineOptions (extra ServerArgs -> argv flags)."""
    from rollout.engines import engine_launch as el
    g = spec.group
    extra = dict(g.extra_sglang_args)
    extra.pop("device", None)  # server_command always passes --device cpu
    for name in ("max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs"):
        if getattr(g, name) is not None:
            extra.setdefault(name, getattr(g, name))
    if g.pp > 1:
        extra.setdefault("pp_size", g.pp)
    if g.moe_a2a_backend not in (None, "none"):
        extra.setdefault("moe_a2a_backend", g.moe_a2a_backend)
    kw = {}
    if "attention_backend" in extra:
        kw["attention_backend"] = str(extra.pop("attention_backend"))
    if "max_total_tokens" in extra:
        kw["max_total_tokens"] = int(extra.pop("max_total_tokens"))
    if g.mem_fraction_static is not None:
        kw["mem_fraction_static"] = g.mem_fraction_static
    spec_dec = None
    if g.speculative is not None:
        s = g.speculative
        spec_dec = {"algorithm": s.algorithm, "num_steps": s.num_steps, "eagle_topk": s.eagle_topk,
                    "num_draft_tokens": s.num_draft_tokens}
        if s.draft_model_path:
            extra.setdefault("speculative_draft_model_path", s.draft_model_path)
    return el.EngineOptions(
        model_path=spec.model_path, tp=g.tp, dp=g.dp, ep=g.ep, moe_dense_tp=g.moe_dense_tp,
        enable_dp_attention=g.enable_dp_attention, enable_dp_lm_head=g.enable_dp_lm_head,
        speculative=spec_dec, routed_experts=g.routed_experts, host=spec.host, port=spec.port,
        api_key=spec.api_key, extra_args=sglang_flags(extra), env=dict(g.env), **kw)


def sglang_flags(args: dict) -> list[str]:
    """{"disable_cuda_graph": True, "cuda_graph_bs": [1, 2]} -> ["--disable-cuda-graph", "--cuda-graph-bs", "1", "2"]."""
    out = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, list):
            out += [flag] + [str(x) for x in v]
        else:
            out += [flag, str(v)]
    return out


def read_tail(path: str, n: int = 20) -> list[str]:
    """Last n non-empty lines of a log file (cheap: reads at most the last 64 KiB)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [ln.rstrip() for ln in data.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-n:]


def _die_with_parent():
    """preexec_fn: SIGKILL this child when the process that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def group_pids(pgid: int) -> list[int]:
    """Live processes (not zombies) whose process group is pgid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                st = fh.read()
        except OSError:
            continue
        fields = st[st.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d))
    return out


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM a process group, wait up to grace_s, then SIGKILL whatever is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not group_pids(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end and group_pids(pgid):
            time.sleep(0.1)


class ServerProcess:
    """A server child process in its own session (so the whole tree can be signalled), logging to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str, die_with_parent: bool = False):
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.update(env)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent if die_with_parent else None)
        self.pid = self.proc.pid

    def returncode(self) -> Optional[int]:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's main process only (what a crash looks like)."""
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 10.0) -> None:
        kill_group(self.pid, grace_s)
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass

    def leftover_pids(self) -> list[int]:
        return group_pids(self.pid)


class Engine:
    """Handle on one started engine; the same shape for every backend."""

    backend = "local"

    def __init__(self, spec: EngineSpec, proc: ServerProcess):
        self.spec = spec
        self._proc = proc
        self.started_at = time.monotonic()

    name = property(lambda self: self.spec.name)
    url = property(lambda self: self.spec.url)
    api_key = property(lambda self: self.spec.api_key)
    pid = property(lambda self: self._proc.pid)
    log_path = property(lambda self: self._proc.log_path)

    def alive(self) -> bool:
        return self._proc.alive()

    def exit_reason(self) -> str:
        rc = self._proc.returncode()
        if rc is None:
            return "process is running"
        if rc < 0:
            return f"process killed by signal {signal.Signals(-rc).name}"
        return f"process exited with code {rc}"

    def log_tail(self, n: int = 20) -> list[str]:
        return read_tail(self.log_path, n)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self._proc.kill(sig)

    def stop(self) -> None:
        self._proc.stop()

    def leftover_pids(self) -> list[int]:
        return self._proc.leftover_pids()


class LocalBackend:
    """Engines as child processes of this one (single node)."""

    name = "local"

    def __init__(self, log_dir: str, command: Command | None = None):
        self.log_dir = log_dir
        self.command = command or default_command
        self._starts: dict[str, int] = {}

    def log_path(self, spec: EngineSpec) -> str:
        n = self._starts.get(spec.name, 0)
        return os.path.join(self.log_dir, f"{spec.name}.log" if n == 0 else f"{spec.name}.restart{n}.log")

    def start(self, spec: EngineSpec) -> Engine:
        if port_in_use(spec.host, spec.port):
            raise EngineStartError(f"port {spec.port} on {spec.host} is already taken")
        argv, env = self.command(spec)
        path = self.log_path(spec)
        self._starts[spec.name] = self._starts.get(spec.name, 0) + 1
        try:
            proc = ServerProcess(argv, env, path)
        except OSError as e:
            raise EngineStartError(f"cannot execute {argv[0]!r}: {e.strerror or e}") from None
        return Engine(spec, proc)

    def shutdown(self) -> None:
        pass
