"""`retraction_reason` on meta_info built by SGLang's OWN code (`weight_versions` spans from
`compute_weight_version_spans` + `add_weight_versions_to_meta_info`, `num_retractions` as the
tokenizer manager reports it), and the dispatcher refusing such a sample. The real engine run is
`test_retraction_engine.py::test_retraction_across_weight_update_refused`."""
from types import SimpleNamespace

import pytest

from rollout.dispatch import Dispatcher, Sample
from rollout.routed_experts.retraction import retraction_reason

wv = pytest.importorskip("sglang.srt.utils.weight_versions")


def _meta(retractions, changes, current, n_out):
    """changes: [(old_version, num_output_tokens at the change)], as SGLang records them."""
    events = [wv.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in changes]
    meta = {"num_retractions": retractions, "routed_experts": "AAAA"}
    wv.add_weight_versions_to_meta_info(meta, wv.compute_weight_version_spans(events, current, n_out), n_out)
    return meta


def test_reason_only_for_retraction_across_versions():
    assert retraction_reason(_meta(0, [("v1", 20)], "v2", 60)) is None   # update, no retraction: rows per forward
    assert retraction_reason(_meta(2, [], "v1", 60)) is None             # retraction, one version: rows recomputed equal
    reason = retraction_reason(_meta(1, [("v1", 20)], "v2", 60))
    assert reason == ("retracted 1x across weight versions v1 -> v2: the re-prefill recomputed the routed "
                      "experts of output tokens [0, 20) under newer weights than their logprobs")
    assert retraction_reason({}) is None


def test_dispatcher_marks_the_sample_failed():
    decoded = []
    shell = SimpleNamespace(decode_routed=lambda *a: decoded.append(a) or ("rows", None))
    s = Sample(sample_id="g/0", group_id="g", index=0, prompt_ids=[1, 2])
    Dispatcher._apply_routed(shell, s, _meta(1, [("v1", 20)], "v2", 60), 0)
    assert s.status == "failed" and s.error.startswith("routed experts: retracted 1x across weight versions v1 -> v2")
    assert decoded == [] and s.routed_experts is None
    ok = Sample(sample_id="g/1", group_id="g", index=1, prompt_ids=[1, 2])
    Dispatcher._apply_routed(shell, ok, _meta(0, [("v1", 20)], "v2", 60), 0)
    assert ok.routed_experts == "rows" and ok.status == "pending"
