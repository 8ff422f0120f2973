"""The durable output of `run`: an append-only JSONL file, one fsync'd line per finished group.

Next to OUTPUT, `OUTPUT.run.json` holds what identifies the run (run id, config, seed, group count),
so `run --resume OUTPUT` re-creates the same prompts and group ids and runs only the groups that have
no line yet. A group's line is written with one `write()` on an O_APPEND descriptor and fsync'd
before the next, so after a kill -9 the file holds whole lines plus at most one torn last line
(which resume cuts off, saying so; that group is run again). An existing OUTPUT is never truncated
unless the caller asks (`overwrite=True`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rollout.errors import CliError

KEYS = ("run_id", "config", "seed", "num_groups")   # what must match for a resume


def meta_path(path: str) -> str:
    return path + ".run.json"


@dataclass
class Resumed:
    meta: dict
    done: set = field(default_factory=set)      # group ids with a line
    duplicates: int = 0                         # lines of a group id seen before (should stay 0)
    torn_bytes: int = 0                         # torn last line cut off


class GroupLog:
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.lines = 0

    def append(self, record: dict) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())
        os.fsync(self.fd)
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
        missing = [k for k in KEYS if k not in meta]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
    except ValueError as e:
        raise CliError(f"--resume: {meta_path(path)} is not a run description ({e})") from None
    return meta


def resume(path: str) -> tuple[GroupLog, Resumed]:
    """Read what a killed run left; the returned log appends after its last whole line."""
    out = Resumed(read_meta(path))
    if os.path.exists(path):
        with open(path, "rb") as fh:
            data = fh.read()
        whole = data.rfind(b"\n") + 1
        out.torn_bytes = len(data) - whole
        for n, line in enumerate(data[:whole].splitlines(), 1):
            try:
                gid = json.loads(line)["group_id"]
            except (ValueError, KeyError, TypeError):
                raise CliError(f"--resume: {path} line {n} is not a group record; not touching the file") from None
            out.duplicates += gid in out.done
            out.done.add(gid)
        if out.torn_bytes:
            os.truncate(path, whole)
    return GroupLog(path), out


def _count_lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
