"""States are enums whose values are what callers and JSON read (rollout/types.py, sglang_patches/states.py)."""
import json

import pytest

from rollout.types import FINISH_STATUS, EngineEvent, SampleStatus
from sglang_patches.states import FixState

pytestmark = pytest.mark.timeout(60)


def test_sample_status_reads_as_its_text_everywhere():
    assert json.dumps({"status": SampleStatus.ABORTED}) == '{"status": "aborted"}'
    assert SampleStatus.FAILED == "failed" and SampleStatus("truncated") is SampleStatus.TRUNCATED
    assert [s for s in SampleStatus if s.runnable] == [SampleStatus.PENDING, SampleStatus.ABORTED]
    # SGLang's finish_reason.type values (tests/facts/sglang-0.5.23-*.json: "length", "abort")
    assert FINISH_STATUS["abort"] is SampleStatus.ABORTED and FINISH_STATUS["length"] is SampleStatus.TRUNCATED


@pytest.mark.parametrize("enum", [SampleStatus, EngineEvent, FixState])
def test_every_state_has_its_own_value(enum):
    """Iterating an Enum skips aliases (a member whose value repeats another's): only `__members__`
    shows them, so compare the two."""
    assert list(enum.__members__) == [m.name for m in enum], f"{enum.__name__} has aliases"


def test_an_alias_is_caught():
    from enum import Enum

    class Twice(str, Enum):
        A = "a"
        B = "a"   # an alias of A

    assert list(Twice.__members__) != [m.name for m in Twice]


def test_every_fix_verdict_is_a_fix_state():
    from sglang_patches.registry import all_fixes, judge, sglang_version

    ver = sglang_version()
    states = {FixState(judge(fix, ver).state) for fix in all_fixes()}   # raises on an unknown state
    assert states and all(isinstance(s, FixState) for s in states)
    assert {s.value for s in FixState if s.good} == {"active", "upstream", "not-needed", "absent", "idle"}
