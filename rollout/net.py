"""Small network helpers, each in one place: the API-key header, free ports and
private (0600) key files. Imports nothing from the rest of the package."""
from __future__ import annotations

import os
import random
import socket

MAX_PORT = 65535 - 10000  # SGLang 0.5.15.post1 derives its gRPC port as port + 10000 and refuses one above 65535
MIN_PORT = 10000
PORT_TRIES = 200  # random picks before free_port gives up
_RANDOM = random.SystemRandom()  # a test's random.seed() must not make two processes pick the same ports


def auth_headers(api_key: str | None) -> dict:
    """The header an engine's API key travels in (none for a keyless engine)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def ephemeral_ports() -> tuple[int, int]:
    """The OS's range for the local ports of outgoing connections (Linux's default if unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, low enough for every reviewed SGLang release, and outside the
    OS's ephemeral range: an engine binds its port only at the end of its start (minutes on a loaded
    machine), and meanwhile any outgoing connection on the machine may take a port from that range."""
    lo, hi = ephemeral_ports()
    outside = [r for r in ((MIN_PORT, min(lo - 1, MAX_PORT)), (max(hi + 1, MIN_PORT), MAX_PORT)) if r[0] <= r[1]]
    for _ in range(PORT_TRIES):
        port = _RANDOM.randint(*_RANDOM.choice(outside)) if outside else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except socket.gaierror as e:  # the host does not resolve: no port will ever bind
                raise OSError(f"cannot pick a port on host {host!r}: {e.strerror or e}") from None
            except OSError:  # in use (or not an address of this machine)
                continue
            port = s.getsockname()[1]
        if port <= MAX_PORT:
            return port
    raise OSError(f"no free port on host {host!r} after {PORT_TRIES} tries (is it an address of this machine?)")


def write_private(path: str, text: str) -> str:
    """Write `text` to `path`, readable by this user only (0600, also when the file existed); returns path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path
