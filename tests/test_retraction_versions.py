"""What each reviewed SGLang does around retraction, run in its own environment (tests/retraction_facts.py),
pinned as literal facts. They are why `retraction_reason` reads two shapes of `meta_info`:

- every version: `Req.reset_for_retract` drops the routed rows and keeps the output tokens (the re-prefill
  recomputes their rows, under whatever weights are loaded then); `meta_info` has `num_retractions`;
  `/update_weight_version` exists (Miles calls it between `pause_generation(mode="retract")` and
  `continue_generation`); the pause's default mode is "abort" (slime posts `{}`: it retracts nothing).
- 0.5.23 reports per-token `weight_versions` spans; 0.5.15.post1 and 0.5.16 report only the version at
  finish (`weight_version`), so there the dispatcher compares it with the version when the request was sent.
"""
import json
import subprocess

import pytest
from support import ROOT
from sglang_patches.scenarios.runner import env_python
from support.variant_runs import python_of

COMMON = {"pause_default_mode": "abort", "routed_experts_after_retract": None, "output_ids_after_retract": [5, 6],
          "retraction_count": 1, "meta_num_retractions": True, "update_weight_version_endpoint": True}
SPANS = {"meta_weight_versions_spans": True, "spans_module": True, "meta_weight_version_at_finish": False}
FINISH_ONLY = {"meta_weight_versions_spans": False, "spans_module": False, "meta_weight_version_at_finish": True}
FACTS = {"0.5.23": {**COMMON, **SPANS}, "0.5.15.post1": {**COMMON, **FINISH_ONLY}, "0.5.16": {**COMMON, **FINISH_ONLY}}


_procs = {}


def facts_of(variant):
    """The probe's answer; the first call starts it in every environment at once."""
    if not _procs:
        for v in FACTS:
            py = ROOT / ".venv" / "bin" / "python" if v == "0.5.23" else env_python(v)
            if py.exists():
                _procs[v] = subprocess.Popen([str(py), str(ROOT / "tests" / "retraction_facts.py")], cwd=ROOT,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if variant not in _procs:
        python_of(variant)  # skips, or fails where the matrix requires the environment
    out, err = _procs[variant].communicate(timeout=280)
    assert _procs[variant].returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(FACTS))
def test_retraction_facts_per_version(variant):
    facts = facts_of(variant)
    assert facts.pop("version") == variant
    assert facts == FACTS[variant]
