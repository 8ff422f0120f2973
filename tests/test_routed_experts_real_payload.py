"""Routed experts captured from the REAL SGLang 0.5.23 CPU engine on the tiny GLM-4.5 model.

``CAPTURED`` (tests/facts/sglang-0.5.23-routed-experts-tiny.json) was saved by
``python tests/test_routed_experts_real_payload.py --capture > FACT`` (engine
preset "a": one rank, ``--enable-return-routed-experts``, greedy; tiny GLM-4.5 "random" variant,
seed 0, ``rollout.models.tiny`` BUILDER_VERSION 1 / VOCAB 300; preset "b" with NEXTN speculative
decoding returned byte-identical payloads). ``expected_experts`` holds, per MoE layer, the expert
sets that model routes to by construction (``tiny_model.expected_experts`` at capture time), so
the data stays valid when the tiny model changes. The payloads must validate, decode to exactly
those sets, and join across a real partial rollout (``routed_experts_start_len``) into the same
rows as the one-shot request.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from rollout.routed_experts import MoELayout, expand, sample_routed_experts

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 11]
FACT = Path(__file__).parent / "facts" / "sglang-0.5.23-routed-experts-tiny.json"
CAPTURED = json.loads(FACT.read_text())


def _layout():
    return MoELayout.from_hf_config(CAPTURED["hf_config"])


def _tokens(rec):
    return rec["input_ids"] + rec["output_ids"]


@pytest.mark.parametrize("name", ["full", "short_prompt"])
def test_real_payload_validates_and_matches_model_routing(name):
    rec, lay = CAPTURED[name], _layout()
    tokens = _tokens(rec)
    comp, reason = sample_routed_experts(rec["meta_info"], len(tokens), lay)
    assert reason is None and comp.dtype == np.uint8 and comp.shape == (len(tokens) - 1, 2, 4)
    for j, layer in enumerate(lay.moe_layers):
        assert [sorted(r) for r in comp[:, j].tolist()] == rec["expected_experts"][str(layer)]


def test_real_partial_rollout_joins_to_one_shot_rows():
    lay, full, first, cont = _layout(), CAPTURED["full"], CAPTURED["first"], CAPTURED["continued"]
    assert _tokens(cont) == _tokens(full)  # greedy: the resumed request finished the same text
    one_shot, _ = sample_routed_experts(full["meta_info"], len(_tokens(full)), lay)
    held, reason = sample_routed_experts(first["meta_info"], len(_tokens(first)), lay)
    assert reason is None
    merged, reason = sample_routed_experts(cont["meta_info"], len(_tokens(cont)), lay, held=held,
                                           start_len=cont["start_len"])
    assert reason is None
    np.testing.assert_array_equal(merged, one_shot)
    np.testing.assert_array_equal(expand(merged, lay)[:, 0], 0)  # dense layer 0 is not in the compact form


def test_real_continuation_without_start_len_is_rejected():
    cont = CAPTURED["continued"]
    comp, reason = sample_routed_experts(cont["meta_info"], len(_tokens(cont)), _layout())
    assert comp is None and reason == "routed_experts has 7 rows, expected len(tokens)-1-start_len=19"


def _capture():  # needs the real engine: a few minutes on 2 cores
    import tempfile

    import requests
    from support.engines import preset, start_engine, stop_engine

    from rollout.models import tiny as tiny_model
    from rollout.net import auth_headers

    eng = start_engine(preset("a", tiny_model.build_tiny_glm()), tempfile.mkdtemp(prefix="re-capture-"), 600)
    try:
        def gen(ids, n, start_len=0):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0},
                    "return_routed_experts": True, "routed_experts_start_len": start_len}
            r = requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), json=body, timeout=300)
            r.raise_for_status()
            j = r.json()
            return {"input_ids": ids, "output_ids": j["output_ids"], "start_len": start_len,
                    "meta_info": {"routed_experts": j["meta_info"]["routed_experts"]}}

        out = {"full": gen(PROMPT, 10), "short_prompt": gen([200, 201, 3, 44], 10), "first": gen(PROMPT, 4)}
        resumed = PROMPT + out["first"]["output_ids"]
        out["continued"] = gen(resumed, 6, start_len=len(resumed) - 2)
        cfg = tiny_model.model_config(0)
        for rec in (out["full"], out["short_prompt"]):
            rec["expected_experts"] = {str(layer): tiny_model.expected_experts(_tokens(rec)[:-1], layer)
                                       for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])}
        out["hf_config"] = {k: cfg[k] for k in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                                "first_k_dense_replace")}
        print(json.dumps(out))
    finally:
        stop_engine(eng)


if __name__ == "__main__" and "--capture" in sys.argv:
    _capture()
