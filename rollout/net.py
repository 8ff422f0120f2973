"""Small network helpers, each in one place: the API-key header, free ports and
private (0600) key files. Imports nothing from the rest of the package."""
from __future__ import annotations

import os
import socket

MAX_PORT = 65535 - 10000  # SGLang 0.5.15.post1 derives its gRPC port as port + 10000 and refuses one above 65535


def auth_headers(api_key: str | None) -> dict:
    """The header an engine's API key travels in (none for a keyless engine)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, low enough for every reviewed SGLang release."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port <= MAX_PORT:
            return port


def write_private(path: str, text: str) -> str:
    """Write `text` to `path`, readable by this user only (0600, also when the file existed); returns path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path
