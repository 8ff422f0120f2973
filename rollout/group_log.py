"""The durable output of `run`: an append-only JSONL file, one fsync'd line per finished group.

Next to OUTPUT, `OUTPUT.run.json` holds what identifies the run (run id, config, seed, group count),
so `run --resume OUTPUT` re-creates the same prompts and group ids and runs only the groups that have
no line yet. A group's line is written with one `write()` on an O_APPEND descriptor and fsync'd
before the next, so after a kill -9 the file holds whole lines plus at most one torn last line
(which resume cuts off, saying so; that group is run again). An existing OUTPUT is never truncated
unless the caller asks (`overwrite=True`).
"""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field

from rollout.errors import CliError

KEYS = {"run_id": str, "config": str, "seed": int, "num_groups": int}   # what must match for a resume


class WriteError(RuntimeError):
    """Writing a group's line failed (one line: the file and the OS error); `run` exits 1."""


def meta_path(path: str) -> str:
    return path + ".run.json"


@dataclass
class Resumed:
    meta: dict
    done: set = field(default_factory=set)      # group ids with a line
    torn_bytes: int = 0                         # torn last line cut off


class GroupLog:
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lines = 0

    def append(self, record: dict) -> None:
        """One whole line, fsync'd; on a write error (disk full, EIO, a file size limit) the partial line is
        cut off again and a one-line `WriteError` names the file and the OS error: the file stays whole."""
        try:
            data = (json.dumps(record) + "\n").encode()
        except (TypeError, ValueError) as e:
            raise WriteError(f"cannot write a line to {self.path}: the group record is not JSON ({e})") from None
        start = os.fstat(self.fd).st_size
        try:
            done = 0
            while done < len(data):  # a short write is retried; a write that makes no progress is refused
                n = os.write(self.fd, data[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                done += n
            os.fsync(self.fd)
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise WriteError(f"cannot write to {self.path}: {e.strerror or e} (errno {e.errno}); "
                             f"{self.lines} line(s) of this run written whole") from None
        self.lines += 1

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _write_meta(path: str, meta: dict) -> None:
    tmp = meta_path(path) + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, meta_path(path))


def start(path: str, meta: dict, overwrite: bool = False) -> GroupLog:
    """A new run's output; refuses (one line) to replace a non-empty file unless `overwrite`."""
    if os.path.exists(path) and os.path.getsize(path) and not overwrite:
        raise CliError(f"--output: {path} already holds {_count_lines(path)} line(s); continue it with "
                       f"--resume {path}, or replace it with --overwrite")
    if overwrite and os.path.exists(path):
        os.truncate(path, 0)
    _write_meta(path, meta)
    return GroupLog(path)


def read_meta(path: str) -> dict:
    """The run description next to `path` (one-line CliError when missing or broken)."""
    if not os.path.exists(meta_path(path)):
        raise CliError(f"--resume: {meta_path(path)} not found ({path} was not written by `run`)")
    try:
        with open(meta_path(path)) as fh:
            meta = json.load(fh)
        if not isinstance(meta, dict):
            raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
        missing = [k for k in KEYS if k not in meta]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        for k, t in KEYS.items():
            if not isinstance(meta[k], t) or isinstance(meta[k], bool):
                raise ValueError(f"{k}: expected {t.__name__}, got {meta[k]!r}")
        if meta["num_groups"] < 1 or not isinstance(meta.get("prompts"), (dict, type(None))):
            raise ValueError("num_groups must be >= 1 and prompts an object or null")
        updates = meta.setdefault("weight_updates", [])   # a run written before updates were recorded: none
        if not isinstance(updates, list) or not all(
                isinstance(u, list) and len(u) == 2 and type(u[0]) is int and u[0] >= 1 and isinstance(u[1], str)
                for u in updates):
            raise ValueError(f"weight_updates: expected a list of [after, checkpoint], got {updates!r}")
    except (ValueError, UnicodeDecodeError) as e:
        raise CliError(f"--resume: {meta_path(path)} is not a run description ({e})") from None
    return meta


def resume(path: str) -> tuple[GroupLog, Resumed]:
    """Read what a killed run left; the returned log appends after its last whole line. A line of another
    run id or a second line of a group is refused (one line), the file untouched."""
    out = Resumed(read_meta(path))
    prefix = out.meta["run_id"] + "-g"
    if os.path.exists(path):
        with open(path, "rb") as fh:
            data = fh.read()
        whole = data.rfind(b"\n") + 1
        out.torn_bytes = len(data) - whole
        for n, line in enumerate(data[:whole].splitlines(), 1):
            try:
                gid = json.loads(line)["group_id"]
                if not isinstance(gid, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise CliError(f"--resume: {path} line {n} is not a group record; not touching the file") from None
            k = gid[len(prefix):]
            if not (gid.startswith(prefix) and k.isdigit() and int(k) < out.meta["num_groups"]):
                raise CliError(f"--resume: {path} line {n} is group {gid}, not of run {out.meta['run_id']} "
                               f"({meta_path(path)}); not touching the file")
            if gid in out.done:
                raise CliError(f"--resume: {path} line {n} repeats group {gid}; not touching the file")
            out.done.add(gid)
        if out.torn_bytes:
            os.truncate(path, whole)
    return GroupLog(path), out


def _count_lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
