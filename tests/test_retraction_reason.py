"""`retraction_reason` on meta_info built by SGLang's OWN code (`weight_versions` spans from
`compute_weight_version_spans` + `add_weight_versions_to_meta_info`, `num_retractions` as the
tokenizer manager reports it), and the routed-experts entry point and the dispatcher refusing such a
sample. The real engine run is `test_retraction_engine.py::test_retraction_across_weight_update_refused`."""
from types import SimpleNamespace

import pytest

from rollout.engines.client import EngineClient
from rollout.dispatch import Dispatcher
from rollout.routed_experts import MoELayout, encode_sglang, sample_routed_experts
from rollout.routed_experts.retraction import retraction_reason
from support.synthetic import synthetic_full
from rollout.types import Sample, SampleStatus

wv = pytest.importorskip("sglang.srt.utils.weight_versions")

LAY = MoELayout.from_first_k_dense(2, 1, 8, 2)
ROWS = encode_sglang(synthetic_full(2, LAY))   # prompt [1, 2] + one generated token: 2 rows


def _meta(retractions, changes, current, n_out):
    """changes: [(old_version, num_output_tokens at the change)], as SGLang records them."""
    events = [wv.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in changes]
    meta = {"num_retractions": retractions, "routed_experts": ROWS}
    wv.add_weight_versions_to_meta_info(meta, wv.compute_weight_version_spans(events, current, n_out), n_out)
    return meta


def test_reason_only_for_retraction_across_versions():
    assert retraction_reason(_meta(0, [("v1", 20)], "v2", 60)) is None   # update, no retraction: rows per forward
    assert retraction_reason(_meta(2, [], "v1", 60)) is None             # retraction, one version: rows recomputed equal
    reason = retraction_reason(_meta(1, [("v1", 20)], "v2", 60))
    assert reason == ("retracted 1x across weight versions v1 -> v2: the re-prefill recomputed the routed "
                      "experts of output tokens [0, 20) under newer weights than their logprobs")
    assert retraction_reason({}) is None


def test_routed_experts_entry_point_refuses_the_retracted_rows():
    arr, reason = sample_routed_experts(_meta(1, [("v1", 20)], "v2", 60), 3, LAY)
    assert arr is None and reason.startswith("retracted 1x across weight versions v1 -> v2")
    arr, reason = sample_routed_experts(_meta(0, [("v1", 20)], "v2", 60), 3, LAY)
    assert reason is None and arr.shape == (2, 1, 2)


def _finish_only(retractions, version):
    """meta_info as SGLang 0.5.15.post1 / 0.5.16 build it: the version at finish, no spans
    (tests/test_retraction_versions.py pins that shape on their code)."""
    return {"num_retractions": retractions, "weight_version": version, "routed_experts": ROWS,
            "output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "length"}}


def test_reason_without_spans_compares_the_version_when_sent():
    assert retraction_reason(_finish_only(0, "v2"), "v1") is None        # update, no retraction
    assert retraction_reason(_finish_only(3, "v1"), "v1") is None        # retraction, same weights
    assert retraction_reason(_finish_only(1, "v2"), "v1") == (
        "retracted 1x and the weight version was 'v1' when sent, 'v2' at the end (this SGLang reports no "
        "per-token versions): the routed experts of tokens generated before an update may be the newer "
        "weights' routes")
    assert "was None when sent" in retraction_reason(_finish_only(1, "v1"), None)   # unknown: refused


@pytest.mark.timeout(60)
def test_dispatcher_tracks_the_engine_version_per_attempt():
    """The fake SGLang server answering as 0.5.16 does: the version it last reported is the sent version of the
    next attempt; a retracted answer under a newer version fails the sample, a retraction alone does not."""
    import asyncio

    from aiohttp import web
    from support.fake_sglang import FakeSGLang

    answers = [_finish_only(0, "v1"), _finish_only(1, "v2"), _finish_only(1, "v2")]

    async def generate(request):
        await request.json()
        return web.json_response({"text": "", "meta_info": answers.pop(0)})

    async def main():
        server = await FakeSGLang({"/generate": generate}, shutdown_timeout=0.5).serve()
        runner, port = server.runner, server.port
        try:
            async with EngineClient() as session:
                d = Dispatcher(session, {"max_new_tokens": 1}, capacity=1, layout=LAY)
                await d.admit(SimpleNamespace(name="e", url=f"http://127.0.0.1:{port}", api_key=None), "v1")
                out = [await d.run(Sample(f"g/{i}", "g", i, [1, 2])) for i in range(3)]
        finally:
            await runner.cleanup()
        return out

    first, across, alone = asyncio.run(main())
    assert first.sent_version == "v1" and first.routed_experts.shape == (2, 1, 2)
    assert across.sent_version == "v1" and across.status is SampleStatus.FAILED and across.routed_experts is None
    assert across.error.startswith("routed experts: retracted 1x and the weight version was 'v1' when sent, 'v2'")
    assert (alone.sent_version, alone.routed_experts.shape, alone.error) == ("v2", (2, 1, 2), None)


def test_engine_with_the_retraction_fix_keeps_the_sample():
    """An answer whose stamp the engine earned (the scheduler's word in meta_info: rows kept for every retraction,
    or an opt-out) is kept across a weight update, in both meta_info shapes; without the stamp, with a stamp
    but no evidence (the shape an engine stamping every answer sent), or with rows the scheduler recomputed (a
    cap), the same answer is refused and the reason says which."""
    from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, META_KEY, RECOMPUTED, SAMPLING_TIME

    kept = {META_KEY: SAMPLING_TIME, EVIDENCE_KEY: {"rule": SAMPLING_TIME, "retractions": 1, "kept_rows": 6}}
    asked = {META_KEY: RECOMPUTED, EVIDENCE_KEY: {"rule": RECOMPUTED, "asked": True}}
    capped = {META_KEY: RECOMPUTED, EVIDENCE_KEY: {"rule": RECOMPUTED, "why": "its kept rows would take 9 MB"}}
    for meta in (_meta(1, [("v1", 20)], "v2", 60), _finish_only(1, "v2")):
        assert retraction_reason(meta, "v1").startswith("retracted 1x")
        assert retraction_reason({**meta, **kept}, "v1") is None
        assert retraction_reason({**meta, **asked}, "v1") is None
        for rule in (SAMPLING_TIME, RECOMPUTED):   # a stamp alone is not evidence
            assert retraction_reason({**meta, META_KEY: rule}, "v1").startswith(
                f"stamped {rule!r} without the scheduler's evidence; retracted 1x")
        assert retraction_reason({**meta, **capped}, "v1").startswith(
            "its rows were recomputed (its kept rows would take 9 MB); retracted 1x")
        fewer = {**kept, EVIDENCE_KEY: {**kept[EVIDENCE_KEY], "retractions": 0}}   # a retraction the fix never saw
        assert "for 1 retraction(s)" in retraction_reason({**meta, **fewer}, "v1")
        assert retraction_reason({**meta, META_KEY: "something-else"}, "v1") is not None
    assert retraction_reason({**_finish_only(1, "v1"), **capped}, "v1") is None   # recomputed, same weights: equal
    arr, reason = sample_routed_experts({**_finish_only(1, "v2"), **kept}, 3, LAY, sent_version="v1")
    assert reason is None and arr.shape == (2, 1, 2)
