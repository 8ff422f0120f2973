"""Scenario lists: real SGLang code on the paths the fix set changes, run on every reviewed release.

`patches review`, the version matrix (tests/) and the GPU check share them, so they ship here.
- `dp.py`: the DP-attention list. Add a scenario with `@scenario("<fix name>", "defect"|"guard"|"reach")`
  on a function returning {"ok": bool, "detail": str}; a defect's stock needle goes in `EXPECT_STOCK`.
- `drivers.py`: the per-release API a scenario needs (one class per release whose API differs).
- `guards.py`: probes of what SGLang handles itself, shared with tests.
- `runner.py`: runs a list in fresh processes (`run_states`), one per plugin state.
Nothing here imports SGLang or torch at import time.
"""
