"""The state of one fix in this environment (`registry.judge`, `patches status`), as an enum.

It mixes in `str`: a state compares equal to its text, so code and JSON written before it still match.
"""
from enum import Enum


class FixState(str, Enum):
    """What the plugin does with one fix here."""

    ACTIVE = "active"  # hooks registered: the fix runs in every SGLang process
    UPSTREAM = "upstream"  # this SGLang version already handles the defect; a guard test proves it
    NOT_NEEDED = "not-needed"  # the defect exists in this version but no shipped configuration reaches it
    ABSENT = "absent"  # this version never had the defect
    IDLE = "idle"  # not needed in this process (e.g. a CPU fix on a GPU engine)
    DISABLED = "disabled"  # switched off by SLIME_MOE_ROLLOUT_DISABLE
    REFUSED = "refused"  # not applied: unreviewed version, changed source, or the plugin is not loaded

    @property
    def good(self) -> bool:
        """Nothing left for the user to do about this fix."""
        return self in (FixState.ACTIVE, FixState.UPSTREAM, FixState.NOT_NEEDED, FixState.ABSENT, FixState.IDLE)
