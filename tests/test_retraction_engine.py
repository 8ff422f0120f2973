"""Retraction and routed experts (miles#3277) on the REAL CPU engine (SGLang 0.5.23). Slow: one engine.

The tiny GLM-4.5 routes by construction (`tiny_model.expected_experts(token, layer, seed)`), so every
route row can be checked against the model that produced it. The requests are streamed and the
engine is paused with `pause_generation(mode="retract")` only once every request has produced
`BEFORE` tokens, so each is retracted for sure (no timing luck, no tiny KV pool):

- Retraction alone (pause retract, continue): SGLang re-prefills and overwrites the host rows, and the
  rows still equal the model's router on every row: a guard.
- Retraction across a weight update, Miles's sequence between steps (`pause_generation(mode="retract")`,
  `flush_cache`, the weight update, `update_weight_version`, `continue_generation`; slime pauses in the
  default "abort" mode, which retracts nothing): the rows of the tokens generated BEFORE the update are
  recomputed by the re-prefill with the NEW weights, while those tokens and their logprobs came from
  the OLD ones (the defect, on stock SGLang). SGLang's own `meta_info` shows it (`num_retractions`,
  `weight_versions` spans) and `retraction_reason` refuses the sample (the dispatcher marks it failed).
  These engines run with the plugin's `retraction-rows` fix disabled (SGLang's own rows); with it on, the
  rows of the tokens generated before the update are the old router's and the sample is kept.
"""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
from support.engines import decode_routed, preset

from rollout.net import auth_headers
from rollout.routed_experts.retraction import retraction_reason
from rollout.models.tiny import NUM_LAYERS, TOP_K, build_tiny_glm, expected_experts
from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, FIX, META_KEY, PER_REQUEST_ENV, RECOMPUTED, SAMPLING_TIME
from sglang_patches.registry import DISABLE_ENV

RETRACTION_FIX = FIX.name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BEFORE = 6     # output tokens every request has from the first weights when the pause is sent
NEW = 96       # max_new_tokens: far more than can be decoded while the pause is on its way
PROMPTS = [[10 + (i * 37 + j * 11) % 180 for j in range(12)] for i in range(2)]


def _engine(engine_pool, tiny_model):
    """An engine without the plugin's retraction-rows fix (SGLang's own rows: what this file pins)."""
    return engine_pool.get("retract", preset("a", tiny_model, env={DISABLE_ENV: RETRACTION_FIX}))


def _stream(eng):
    """Start one streamed request per prompt; returns (threads, seen, last): tokens so far, last chunk."""
    seen, last = [0] * len(PROMPTS), [None] * len(PROMPTS)

    def one(i):
        body = {"input_ids": PROMPTS[i], "stream": True, "return_routed_experts": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
        with requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), json=body, stream=True, timeout=300) as r:
            if r.status_code != 200:
                last[i] = {"error": r.text[:300]}
                return
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    last[i] = json.loads(line[6:])  # cumulative (SGLang's default stream output)
                    seen[i] = len(last[i].get("output_ids") or [])
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads, seen, last


def _pause_after(eng, seen, budget_s=120):
    """Pause in retract mode once every request has BEFORE tokens; returns the counts at that moment."""
    t0 = time.monotonic()
    while min(seen) < BEFORE:
        assert time.monotonic() - t0 < budget_s, f"requests did not reach {BEFORE} tokens in {budget_s} s: {seen}"
        time.sleep(0.02)
    _post(eng, "/pause_generation", {"mode": "retract"})
    at_pause = list(seen)
    assert max(at_pause) < NEW, f"a request finished before the pause: {at_pause}"
    return at_pause


def _post(eng, path, body):
    r = requests.post(eng.url + path, headers=auth_headers(eng.api_key), json=body, timeout=300)
    assert r.status_code == 200, (path, r.text[:300])


def _miles_update(eng, model_path, version):
    """Miles's steps after `pause_generation(mode="retract")`: flush, update, name the version, continue.
    Returns /flush_cache's status (0.5.15.post1 and 0.5.16 refuse it while retracted requests wait: Miles
    retries 60 s and raises; the update then must not flush either, or their scheduler asserts)."""
    flushed = requests.get(eng.url + "/flush_cache", headers=auth_headers(eng.api_key), timeout=60).status_code
    _post(eng, "/update_weights_from_disk", {"model_path": model_path, "flush_cache": flushed == 200})
    _post(eng, "/update_weight_version", {"new_version": version, "abort_all_requests": False})
    _post(eng, "/continue_generation", {})
    return flushed


def _finish(threads, last):
    for t in threads:
        t.join(timeout=300)
    assert all(b and "error" not in b and b["meta_info"]["finish_reason"]["type"] == "length" for b in last), last
    return last


def _rows_matching(ids, body, seed):
    """Route rows whose experts are the seed's router, per row (True/False)."""
    seq = ids + body["output_ids"][:-1]
    routed = decode_routed(body["meta_info"]["routed_experts"], NUM_LAYERS, TOP_K)
    assert routed.shape[0] == len(seq)
    return [all(sorted(routed[r, layer].tolist()) == expected_experts([seq[r]], layer, seed)[0]
                for layer in range(1, NUM_LAYERS)) for r in range(len(seq))]


@pytest.mark.e2e   # the fixed path (test_retraction_across_weight_update_kept_with_the_fix) runs in make test
def test_retraction_alone_keeps_routes_guard(engine_pool, tiny_model):
    eng = _engine(engine_pool, tiny_model)
    threads, seen, last = _stream(eng)
    at_pause = _pause_after(eng, seen)
    _post(eng, "/continue_generation", {})
    out = _finish(threads, last)
    for ids, body in zip(PROMPTS, out):
        meta = body["meta_info"]
        assert meta["num_retractions"] >= 1, meta["num_retractions"]
        assert all(_rows_matching(ids, body, 0)), "routes of a retracted request differ from the router"
        assert retraction_reason(meta) is None
    print(f"retracted at {at_pause} tokens; all {sum(len(p) + NEW - 1 for p in PROMPTS)} rows equal the router")


@pytest.mark.e2e   # the stock witness (its own engine, ~60 s); every release's scenario runs in make test
def test_retraction_across_weight_update_refused(engine_pool, tiny_model):
    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    eng = _engine(engine_pool, tiny_model)
    threads, seen, last = _stream(eng)
    at_pause = _pause_after(eng, seen)
    try:
        assert _miles_update(eng, other, "seed1") == 200  # paused in retract mode: 0.5.23 flushes
        out = _finish(threads, last)
        for i, (ids, body) in enumerate(zip(PROMPTS, out)):
            meta = body["meta_info"]
            spans = meta["weight_versions"]
            print(i, "paused at", at_pause[i], "retractions", meta["num_retractions"], "versions", spans)
            k = spans[1]["start"]  # output tokens [0, k) came from the old weights
            assert meta["num_retractions"] >= 1 and [s["version"] for s in spans] == ["default", "seed1"]
            assert at_pause[i] <= k < NEW
            boundary = len(ids) + k - 1  # rows [0, boundary) fed the old-weight forwards
            old, new = _rows_matching(ids, body, 0), _rows_matching(ids, body, 1)
            assert all(new) and not all(old[:boundary]), \
                "stock SGLang: rows of old-weight tokens are the NEW router's (re-prefill after the update)"
            reason = retraction_reason(meta)
            assert reason and "default -> seed1" in reason and f"[0, {k})" in reason, reason
    finally:
        _post(eng, "/continue_generation", {})
        _post(eng, "/update_weights_from_disk", {"model_path": tiny_model, "weight_version": "default"})


def test_retraction_across_weight_update_kept_with_the_fix(engine_pool, tiny_model):
    """The same sequence on an engine with the plugin's retraction-rows fix: rows of the positions computed before
    the pause are the OLD router's (the routes those tokens were sampled with), the rest the new one's; meta_info
    states the rule and the dispatcher's check keeps the sample."""
    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    eng = engine_pool.get("retract-fix", preset("a", tiny_model))
    threads, seen, last = _stream(eng)
    _pause_after(eng, seen)
    try:
        assert _miles_update(eng, other, "seed1") == 200
        out = _finish(threads, last)
        for ids, body in zip(PROMPTS, out):
            meta = body["meta_info"]
            k = meta["weight_versions"][1]["start"]
            boundary = len(ids) + k - 1
            old, new = _rows_matching(ids, body, 0), _rows_matching(ids, body, 1)
            assert meta["num_retractions"] >= 1 and meta[META_KEY] == SAMPLING_TIME
            word = meta[EVIDENCE_KEY]   # the scheduler's word, through SGLang's customized_info (streamed)
            assert word["rule"] == SAMPLING_TIME and word["retractions"] >= meta["num_retractions"], word
            assert word["kept_rows"] >= boundary, (word, boundary)
            assert all(old[:boundary]) and all(new[boundary:]), (boundary, old, new)
            assert retraction_reason(meta) is None
    finally:
        _post(eng, "/continue_generation", {})
        _post(eng, "/update_weights_from_disk", {"model_path": tiny_model, "weight_version": "default"})


@pytest.mark.e2e   # ~30 s of engine work; the STATE hook's capped path runs on every release's scenarios in make test
def test_retraction_over_the_cap_is_stamped_recomputed(engine_pool, tiny_model):
    """The same sequence with a per-request kept-rows cap below one request's rows: the scheduler turns the fix off
    for each request at the retraction, its answer says `recomputed` with the cap's line (before the scheduler's
    word reached the tokenizer it said `sampling-time`), its rows are the re-prefill's (the new router's) and
    the client refuses the sample."""
    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    eng = engine_pool.get("retract-capped", preset("a", tiny_model, env={PER_REQUEST_ENV: "0.000001"}))
    threads, seen, last = _stream(eng)
    _pause_after(eng, seen)
    try:
        assert _miles_update(eng, other, "seed1") == 200
        out = _finish(threads, last)
        for ids, body in zip(PROMPTS, out):
            meta = body["meta_info"]
            assert meta["num_retractions"] >= 1 and meta[META_KEY] == RECOMPUTED, meta.get(META_KEY)
            assert "caps:" in meta[EVIDENCE_KEY]["why"], meta[EVIDENCE_KEY]
            assert all(_rows_matching(ids, body, 1)), "capped: the re-prefill's rows (the new router's)"
            assert retraction_reason(meta).startswith("its rows were recomputed (its kept rows would take")
    finally:
        _post(eng, "/continue_generation", {})
        _post(eng, "/update_weights_from_disk", {"model_path": tiny_model, "weight_version": "default"})


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["0.5.15.post1"])
def test_retraction_across_weight_update_refused_without_spans(variant, tiny_model):
    """The same sequence on SGLang 0.5.15.post1 (slime's version; this file's `__main__` runs the engine
    in that environment): `meta_info` has `num_retractions` and only the version at finish, no spans; the
    /flush_cache is accepted while the retracted requests wait (the `weight-update-pause` fix: stock 0.5.15.post1
    refuses it, and Miles's flush_cache raises after 60 s; sglang_patches/scenarios/weight_update.py); the
    dispatcher's check refuses by the version when sent. Rows are
    printed, not asserted: that engine's rows are not yet decided; measured once, no row of either
    request matched the seed-1 router, and request 1's prompt rows matched neither router."""
    from support.engines import ENGINE_BUDGET_S
    from support.variant_runs import python_of

    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    p = subprocess.run([str(python_of(variant)), __file__, tiny_model, other, str(ENGINE_BUDGET_S)], env=env,
                       capture_output=True, text=True, timeout=ENGINE_BUDGET_S + 300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["version"] == variant
    assert got["flush_status"] == 200, got["flush_status"]  # stock: 400 (Miles's flush_cache raises after 60 s)
    for ids, body in zip(PROMPTS, got["out"]):
        meta = body["meta_info"]
        print("retractions", meta["num_retractions"], "version", meta["weight_version"],
              "seed-1 rows", sum(_rows_matching(ids, body, 1)), "of", len(ids) + NEW - 1)
        assert meta["num_retractions"] >= 1 and meta["weight_version"] == "seed1" and "weight_versions" not in meta
        new, old = _rows_matching(ids, body, 1)[1:len(ids)], _rows_matching(ids, body, 0)[1:len(ids)]
        print("prompt rows 1..: seed-1", sum(new), "seed-0", sum(old), "of", len(new))
        assert retraction_reason(meta) is not None          # version when sent unknown: refused
        assert "'default' when sent, 'seed1' at the end" in retraction_reason(meta, "default")


if __name__ == "__main__":   # the child of the test above, in the variant's environment
    import tempfile

    import sglang

    from support.engines import start_engine, stop_engine

    spec = preset("a", sys.argv[1], env={DISABLE_ENV: RETRACTION_FIX})
    eng = start_engine(spec, tempfile.mkdtemp(prefix="engine-retract-"), float(sys.argv[3]))
    try:
        threads, seen, last = _stream(eng)
        at_pause = _pause_after(eng, seen)
        flushed = _miles_update(eng, sys.argv[2], "seed1")
        print(json.dumps({"version": sglang.__version__, "at_pause": at_pause, "flush_status": flushed,
                          "out": _finish(threads, last)}))
    finally:
        assert not stop_engine(eng)[1], "engine processes left"
