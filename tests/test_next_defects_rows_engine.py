"""The stop-edge row on the REAL CPU engine (SGLang 0.5.23, NEXTN preset (b), routed experts): for every
way a response ends (max tokens, a stop token id, a stop string with and without trimming, an abort, a
continued sample) the payload has exactly `len(tokens) - 1` rows, `len(tokens)` = prompt tokens plus the
`output_token_logprobs` tokens, as slime and Miles count them; with NEXTN a stop token can sit inside an
accepted draft run. Each payload validates; the same payload with the final token's routing appended
(what an engine that forwarded the final token sends) keeps the same rows.
"""
import base64
import threading
import time

import numpy as np
import pytest
import requests

from support.engines import preset
from rollout.net import auth_headers
from rollout.routed_experts import MoELayout, decode_compact

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]
LAY = MoELayout.from_first_k_dense(3, 1, 16, 4)  # rollout/models/tiny.py: 1 dense + 2 MoE, 16 experts, top-4
PROMPT = [11 + (7 * j) % 200 for j in range(12)]


@pytest.fixture(scope="module")
def engine(engine_pool, tiny_match_model):
    return engine_pool.get("b", preset("b", tiny_match_model))  # the same engine as test_engine_single


def _gen(engine, sp, ids=PROMPT):
    r = requests.post(engine.url + "/generate", headers=auth_headers(engine.api_key), timeout=300, json={
        "input_ids": ids, "sampling_params": sp, "return_routed_experts": True, "return_logprob": True})
    r.raise_for_status()
    return r.json()


def _wait_running(engine, budget_s=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < budget_s:
        loads = requests.get(engine.url + "/v1/loads", params={"include": "core"}, headers=auth_headers(engine.api_key),
                             timeout=30).json()["loads"]
        if any(ld.get("num_running_reqs") for ld in loads):
            return
        time.sleep(0.05)
    pytest.fail(f"the long request was not running within {budget_s} s")


def _check(out, prompt_len, name):
    mi = out["meta_info"]
    tokens = prompt_len + len(mi["output_token_logprobs"])
    raw = np.frombuffer(base64.b64decode(mi["routed_experts"]), dtype=np.int32)
    rows = raw.size // (LAY.num_hidden_layers * LAY.topk)
    print(f"{name}: finish {mi['finish_reason']['type']}, len(tokens) {tokens}, rows {rows}")
    assert rows == tokens - 1, f"{name}: {rows} rows for {tokens} tokens"
    compact = decode_compact(mi["routed_experts"], LAY, tokens)
    edge = np.concatenate([raw.reshape(rows, 3, 4), raw.reshape(rows, 3, 4)[-1:]])  # a final-token row
    assert np.array_equal(decode_compact(edge, LAY, tokens), compact), name


def test_every_ending_has_len_tokens_minus_one_rows(engine):
    base = _gen(engine, {"max_new_tokens": 10, "temperature": 0})
    _check(base, len(PROMPT), "max tokens")
    ids = base["output_ids"]
    assert base["meta_info"]["spec_accept_length"] > 1.5  # NEXTN accepts draft runs: a stop can sit inside one
    for trim in (False, True):
        _check(_gen(engine, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [ids[4]],
                             "no_stop_trim": trim}), len(PROMPT), f"stop token id (no_stop_trim {trim})")
    text6 = _gen(engine, {"max_new_tokens": 6, "temperature": 0})["text"]
    for trim in (False, True):
        out = _gen(engine, {"max_new_tokens": 10, "temperature": 0, "stop": [text6[-3:]], "no_stop_trim": trim})
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        _check(out, len(PROMPT), f"stop string (no_stop_trim {trim})")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("o", _gen(engine, {"max_new_tokens": 1800, "temperature": 0,
                                                                           "ignore_eos": True})))
    t.start()
    _wait_running(engine)
    time.sleep(0.3)  # a few decode steps, far from 1800 tokens on any machine
    requests.post(engine.url + "/abort_request", headers=auth_headers(engine.api_key), json={"abort_all": True}, timeout=30)
    t.join(120)
    assert got["o"]["meta_info"]["finish_reason"]["type"] == "abort"
    _check(got["o"], len(PROMPT), "abort")
    cont = PROMPT + ids
    _check(_gen(engine, {"max_new_tokens": 5, "temperature": 0}, ids=cont), len(cont), "continued sample")
