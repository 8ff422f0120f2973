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
    assert r.meta == {**META, "weight_updates": []}, "a run written without weight updates recorded: none"
    assert r.done == {"r1-g0", "r1-g2"} and r.torn_bytes == len('{"group_id": "r1-')
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


def _log_with(tmp_path, lines, meta=META):
    out = tmp_path / "o.jsonl"
    group_log.start(str(out), meta, overwrite=True).close()
    out.write_text("".join(json.dumps({"group_id": g}) + "\n" for g in lines))
    return out


def test_resume_refuses_lines_of_another_run_and_duplicates(tmp_path):
    out = _log_with(tmp_path, ["BBB-g0", "BBB-g1", "BBB-g2"])
    with pytest.raises(CliError, match=r"line 1 is group BBB-g0, not of run r1 .*; not touching the file"):
        group_log.resume(str(out))
    out = _log_with(tmp_path, ["r1-g0", "r1-g9"])
    with pytest.raises(CliError, match=r"line 2 is group r1-g9, not of run r1"):  # outside num_groups 3
        group_log.resume(str(out))
    out = _log_with(tmp_path, ["r1-g0", "r1-g1", "r1-g0"])
    with pytest.raises(CliError, match=r"line 3 repeats group r1-g0; not touching the file"):
        group_log.resume(str(out))
    assert out.read_text().count("\n") == 3


@pytest.mark.parametrize("meta, text", [
    ({**META, "num_groups": "3"}, "num_groups: expected int, got '3'"),
    ({**META, "seed": None}, "seed: expected int, got None"),
    ({k: v for k, v in META.items() if k != "config"}, "missing config"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_malformed_run_json_is_one_line(tmp_path, meta, text):
    out = tmp_path / "o.jsonl"
    out.write_text("")
    (tmp_path / "o.jsonl.run.json").write_text(json.dumps(meta))
    with pytest.raises(CliError, match=r"o.jsonl.run.json is not a run description \(" + text.replace("(", r"\(")):
        group_log.resume(str(out))


def test_a_short_write_is_completed_never_counted_half(tmp_path, monkeypatch):
    log = group_log.start(str(tmp_path / "o.jsonl"), META)
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: real(fd, b[:5]))  # the kernel may write less than asked
    log.append({"group_id": "r1-g0"})
    log.close()
    assert (tmp_path / "o.jsonl").read_text() == '{"group_id": "r1-g0"}\n' and log.lines == 1


_FULL_DISK_CHILD = r"""
import json, resource, signal, sys
from rollout import group_log
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)            # then write() fails with EFBIG, as on a full disk
log = group_log.start(sys.argv[1], json.loads(sys.argv[2]))
resource.setrlimit(resource.RLIMIT_FSIZE, (80, 80))      # room for two lines (34 bytes each) and a half
try:
    for i in range(3):
        log.append({"group_id": f"r1-g{i}", "pad": "x"})
except group_log.WriteError as e:
    print(e)
    print(log.lines)
"""


def test_a_real_write_error_leaves_whole_lines_and_one_line_naming_file_and_error(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "o.jsonl"
    p = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(out), json.dumps(META)],
                       capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    msg, lines = p.stdout.splitlines()
    assert msg.startswith(f"cannot write to {out}: File too large (errno 27)"), p.stdout + p.stderr
    assert lines == "2"
    assert [json.loads(x)["group_id"] for x in out.read_text().splitlines()] == ["r1-g0", "r1-g1"]
    log, r = group_log.resume(str(out))   # space freed: resume continues after the whole lines
    log.close()
    assert r.done == {"r1-g0", "r1-g1"} and r.torn_bytes == 0


def test_a_record_json_cannot_encode_is_one_line_and_writes_nothing(tmp_path):
    log = group_log.start(str(tmp_path / "o.jsonl"), META)
    with pytest.raises(group_log.WriteError, match=r"cannot write a line to .*o.jsonl: the group record is not JSON"):
        log.append({"group_id": "r1-g0", "label": {1, 2}})   # e.g. a Parquet label JSON has no type for
    log.close()
    assert (tmp_path / "o.jsonl").read_text() == "" and log.lines == 0
