"""States are enums whose values are what callers and JSON read (rollout/states.py, sglang_patches/states.py)."""
import json

import pytest

from rollout.states import FINISH_STATUS, EngineEvent, SampleStatus
from sglang_patches.states import FixState

pytestmark = pytest.mark.timeout(60)


def test_sample_status_reads_as_its_text_everywhere():
    assert json.dumps({"status": SampleStatus.ABORTED}) == '{"status": "aborted"}'
    assert SampleStatus.FAILED == "failed" and SampleStatus("truncated") is SampleStatus.TRUNCATED
    assert [s for s in SampleStatus if s.runnable] == [SampleStatus.PENDING, SampleStatus.ABORTED]
    # SGLang's finish_reason.type values (tests/facts/sglang-0.5.23-*.json: "length", "abort")
    assert FINISH_STATUS["abort"] is SampleStatus.ABORTED and FINISH_STATUS["length"] is SampleStatus.TRUNCATED


def test_engine_events_are_distinct():
    assert len({e.value for e in EngineEvent}) == len(EngineEvent)


def test_every_fix_verdict_is_a_fix_state():
    from sglang_patches.registry import all_fixes, judge, sglang_version

    ver = sglang_version()
    states = {FixState(judge(fix, ver).state) for fix in all_fixes()}   # raises on an unknown state
    assert states and all(isinstance(s, FixState) for s in states)
    assert {s.value for s in FixState if s.good} == {"active", "upstream", "not-needed", "absent", "idle"}
