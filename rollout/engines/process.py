"""The one process spawner and the one tree-killer for engine server processes.

`ServerProcess` starts argv (never a shell) in its own session, logging to a file, with the node's own
environment plus the engine's env. The child is SIGKILLed when this process dies (PR_SET_PDEATHSIG,
armed from one long-lived spawner thread: the signal follows the thread that forked, and executor
threads come and go); SGLang's own children follow their launcher the same way. The API key goes to a
0600 YAML file passed with SGLang's `--config` (read by 0.5.15.post1, 0.5.16 and 0.5.23 alike), so no
`ps` shows it. `kill_group` is the tree-killer: SIGTERM the session, wait, SIGKILL what is left.
"""
from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Optional

from rollout.net import write_private
from training_configs.server_args import PORTS_PER_ENGINE

FREED_S = 10.0   # how long a killed stale engine's port may take to become free
OWNER_ENV = "SLIME_MOE_ROLLOUT_OWNER"  # "<manager pid>:<port>" on every engine process we start


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def read_tail(path: str, n: int = 20, secret: Optional[str] = None) -> list[str]:
    """Last n non-empty lines of a log file (cheap: reads at most the last 64 KiB), `secret` masked."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    if secret:
        data = data.replace(secret, "***")
    lines = [ln.rstrip() for ln in data.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-n:]


def _die_with_parent():
    """preexec_fn: SIGKILL this child when the thread that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class PortTaken(Exception):
    """An engine's port is held by a process that is not a stale engine of ours."""


class _Spawner:
    """One daemon thread that lives as long as the process and runs every Popen."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def _run(self):
        while True:
            fn, fut = self._q.get()
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)

    def call(self, fn):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="engine-spawner", daemon=True)
                self._thread.start()
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut.result()


_SPAWNER = _Spawner()


def write_secret_config(path: str, api_key: str) -> str:
    """A 0600 YAML file SGLang's --config merges into its arguments (keeps the key off argv)."""
    return write_private(path, f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a valid YAML scalar


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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def alive_pids(pids) -> list[int]:
    """Those of `pids` still running (zombies count as gone)."""
    return [p for p in pids if _alive(p)]


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """The tree-killer: SIGTERM a process group, wait up to grace_s, then SIGKILL whatever is left."""
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

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str, api_key: Optional[str] = None,
                 owner_port: Optional[int] = None):
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        self.log_path = log_path
        self.secret_path = None
        argv = list(argv)
        if api_key:
            self.secret_path = write_secret_config(os.path.abspath(log_path) + ".args.yaml", api_key)
            argv += ["--config", self.secret_path]
        full_env = dict(os.environ)
        full_env.update(env)
        full_env[OWNER_ENV] = f"{os.getpid()}:{owner_port or ''}"
        # SGLang logs its resolved server_args, key included: the log is 0600 too
        with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self.proc = _SPAWNER.call(lambda: subprocess.Popen(
                argv, env=full_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent))
        self.pid = self.proc.pid
        self.argv = argv

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

    def tree_pids(self) -> list[int]:
        """This process and all its descendants (also those that left its session)."""
        import psutil
        try:
            return [self.pid] + [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """The tree-killer on the session, then SIGKILL any descendant that left it; returns PIDs left."""
        tree = self.tree_pids()
        kill_group(self.pid, grace_s)
        for pid in tree:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        if self.secret_path:
            try:
                os.unlink(self.secret_path)
            except OSError:
                pass
        end = time.monotonic() + 10
        while [p for p in tree if _alive(p)] and time.monotonic() < end:
            time.sleep(0.1)
        return [p for p in tree if _alive(p)]

    def leftover_pids(self) -> list[int]:
        return group_pids(self.pid)


def cpu_percent(pids, window: float) -> dict:
    """{pid: (title, % of one core)} of each process over `window` seconds (0 for one that exited)."""
    import psutil

    procs = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            t = p.cpu_times()
            procs[pid] = (p, " ".join(p.cmdline())[:60] or p.name(), t.user + t.system)
        except psutil.NoSuchProcess:
            pass
    time.sleep(window)
    out = {}
    for pid, (p, title, c0) in procs.items():
        try:
            t = p.cpu_times()
            out[pid] = (title, 100.0 * (t.user + t.system - c0) / window)
        except psutil.NoSuchProcess:
            out[pid] = (title + " (exited)", 0.0)
    return out


def rss(pids) -> dict:
    """{pid: (name, resident bytes)} of each process still running."""
    import psutil

    out = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out[pid] = (_title(p), p.memory_info().rss)
        except psutil.NoSuchProcess:
            pass
    return out


def _title(p) -> str:
    """sglang::scheduler_TP0 etc. as SGLang names them; launch_server / resource_tracker by command line."""
    name = p.name()
    if name.startswith("sglang::"):
        return name
    try:
        joined = " ".join(p.cmdline())
    except Exception:
        joined = ""
    for part in ("launch_server", "resource_tracker"):
        if part in joined:
            return part
    return name


def stale_engines(port: int) -> list[tuple[int, str]]:
    """(pid, reason) of processes listening on `port` that an earlier manager (now dead) started."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if not any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                       for c in p.net_connections(kind="inet")):
                continue
            owner = p.environ().get(OWNER_ENV, "")
        except (psutil.Error, OSError):
            continue
        mgr = owner.split(":")[0]
        if mgr.isdigit() and int(mgr) != os.getpid() and not psutil.pid_exists(int(mgr)):
            out.append((p.pid, f"left by manager pid {mgr}, which is gone"))
    return out


def clear_stale(host: str, port: int, ports: int = PORTS_PER_ENGINE) -> list[str]:
    """Kill engines an earlier (dead) manager left on port..port+ports-1; returns one line per kill.
    Raises RuntimeError naming the holder when a port is taken by anything else."""
    import psutil

    notes = []
    for q in range(port, port + ports):
        if not port_in_use(host, q):
            continue
        killed = False
        for pid, why in stale_engines(q):
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            kill_group(pgid, 5.0)
            killed = True
            notes.append(f"killed stale engine pid {pid} on port {q} ({why})")
        end = time.monotonic() + FREED_S
        while killed and port_in_use(host, q) and time.monotonic() < end:
            time.sleep(0.05)   # the killed engine's open connections close a moment after it is gone
        if q == port and port_in_use(host, q):
            holder = ""
            for p in psutil.process_iter(["pid", "name"]):
                try:
                    if any(c.laddr and c.laddr.port == q and c.status == psutil.CONN_LISTEN
                           for c in p.net_connections(kind="inet")):
                        holder = f" by pid {p.pid} ({p.info['name']})"
                        break
                except (psutil.Error, OSError):
                    continue
            holder = holder or " (nothing listens on it: connections of a closed server are still open)"
            raise PortTaken(f"port {q} on {host} is already taken{holder}")
    return notes
