"""The durable output of `run` (rollout/group_log.py): append-only, fsync'd lines, resume after a kill."""
import json
import os

import pytest

from rollout import group_log
from rollout.errors import CliError

pytestmark = pytest.mark.timeout(30)
META = {"run_id": "r1", "config": "c.yaml", "seed": 0, "num_groups": 3}


def test_existing_output_is_never_truncated_without_asking(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"group_id": "x-g0"}\n')
    with pytest.raises(CliError, match=r"already holds 1 line\(s\); continue it with --resume .*--overwrite"):
        group_log.start(str(out), META)
    assert out.read_text() == '{"group_id": "x-g0"}\n'
    group_log.start(str(out), META, overwrite=True).close()
    assert out.read_text() == ""


def test_lines_are_appended_and_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    log = group_log.start(str(tmp_path / "o.jsonl"), META)
    fd, synced[:] = log.fd, []
    log.append({"group_id": "r1-g0"})
    log.append({"group_id": "r1-g1"})
    log.close()
    assert synced.count(fd) == 2  # one fsync per line
    assert [json.loads(x)["group_id"] for x in (tmp_path / "o.jsonl").read_text().splitlines()] == ["r1-g0", "r1-g1"]
    assert json.loads((tmp_path / "o.jsonl.run.json").read_text()) == META


def test_resume_reads_done_groups_and_cuts_only_a_torn_last_line(tmp_path):
    out = tmp_path / "o.jsonl"
    group_log.start(str(out), META).close()
    with open(out, "a") as fh:
        fh.write('{"group_id": "r1-g0"}\n{"group_id": "r1-g2"}\n{"group_id": "r1-')  # killed mid-write
    log, r = group_log.resume(str(out))
    log.append({"group_id": "r1-g1"})
    log.close()
    assert r.meta == META and r.done == {"r1-g0", "r1-g2"} and r.torn_bytes == len('{"group_id": "r1-')
    assert [json.loads(x)["group_id"] for x in out.read_text().splitlines()] == ["r1-g0", "r1-g2", "r1-g1"]


def test_resume_refuses_what_run_did_not_write(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text("hello\n")
    with pytest.raises(CliError, match=r"o.jsonl.run.json not found"):
        group_log.resume(str(out))
    (tmp_path / "o.jsonl.run.json").write_text(json.dumps(META))
    with pytest.raises(CliError, match=r"line 1 is not a group record; not touching the file"):
        group_log.resume(str(out))
    assert out.read_text() == "hello\n"
