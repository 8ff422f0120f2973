"""Routed experts captured from the REAL SGLang 0.5.23 CPU engine on the tiny GLM-4.5 model.

``CAPTURED`` was saved by ``python tests/test_routed_experts_real_payload.py --capture`` (engine
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

import numpy as np
import pytest

from rollout.routed_experts import MoELayout, expand, sample_routed_experts

PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 11]
CAPTURED = json.loads(r"""
{"full": {"input_ids": [5, 17, 42, 99, 123, 7, 250, 31, 64, 11], "output_ids": [60, 210, 53, 86, 93, 250, 257, 210, 53, 86], "start_len": 0, "meta_info": {"routed_experts": "AAAAAAAAAAAAAAAAAAAAAAAAAAABAAAABQAAAA0AAAAEAAAABwAAAAUAAAAPAAAAAAAAAAAAAAAAAAAAAAAAAAQAAAAIAAAACgAAAAsAAAACAAAAAQAAAAsAAAAGAAAAAAAAAAAAAAAAAAAAAAAAAAoAAAAAAAAAAwAAAAcAAAAOAAAABAAAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAoAAAAHAAAABQAAAAYAAAAAAAAABQAAAAIAAAAMAAAAAAAAAAAAAAAAAAAAAAAAAAkAAAAEAAAAAgAAAAoAAAADAAAACwAAAAoAAAACAAAAAAAAAAAAAAAAAAAAAAAAAAkAAAAAAAAACgAAAA0AAAACAAAABAAAAAMAAAAPAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAABAAAABwAAAAMAAAAMAAAABwAAAAAAAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAANAAAAAgAAAAoAAAAKAAAADAAAAA8AAAACAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAANAAAAAwAAAAsAAAAEAAAADgAAAA8AAAAGAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAJAAAADQAAAAUAAAAPAAAAAAAAAAMAAAAFAAAAAAAAAAAAAAAAAAAAAAAAAA4AAAAHAAAAAwAAAAUAAAAJAAAAAAAAAA4AAAAFAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAABAAAABQAAAAkAAAAFAAAABwAAAA0AAAADAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAJAAAAAgAAAAMAAAADAAAACgAAAA0AAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAgAAAAKAAAAAwAAAAYAAAABAAAAAgAAAA4AAAAMAAAAAAAAAAAAAAAAAAAAAAAAAAQAAAALAAAADAAAAAkAAAALAAAABgAAAAgAAAADAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAABAAAABwAAAAMAAAAMAAAABwAAAAAAAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAQAAAAKAAAAAwAAAAsAAAACAAAADgAAAAsAAAAGAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAABAAAABQAAAAkAAAAFAAAABwAAAA0AAAADAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAJAAAAAgAAAAMAAAADAAAACgAAAA0AAAAOAAAA"}, "expected_experts": {"1": [[0, 1, 5, 13], [4, 8, 10, 11], [0, 3, 7, 10], [5, 6, 7, 10], [2, 4, 9, 10], [0, 9, 10, 13], [1, 3, 6, 7], [2, 6, 10, 13], [0, 3, 11, 13], [5, 7, 9, 13], [3, 5, 7, 14], [1, 5, 9, 15], [2, 3, 9, 15], [3, 6, 8, 10], [4, 9, 11, 12], [1, 3, 6, 7], [3, 4, 10, 11], [1, 5, 9, 15], [2, 3, 9, 15]], "2": [[4, 5, 7, 15], [1, 2, 6, 11], [0, 2, 4, 14], [0, 2, 5, 12], [2, 3, 10, 11], [2, 3, 4, 15], [0, 7, 12, 14], [2, 10, 12, 15], [4, 6, 14, 15], [0, 3, 5, 15], [0, 5, 9, 14], [3, 5, 7, 13], [3, 10, 13, 14], [1, 2, 12, 14], [3, 6, 8, 11], [0, 7, 12, 14], [2, 6, 11, 14], [3, 5, 7, 13], [3, 10, 13, 14]]}}, "short_prompt": {"input_ids": [200, 201, 3, 44], "output_ids": [174, 50, 226, 53, 86, 7, 106, 7, 106, 7], "start_len": 0, "meta_info": {"routed_experts": "AAAAAAAAAAAAAAAAAAAAAAgAAAABAAAADQAAAA4AAAABAAAADwAAAAcAAAAJAAAAAAAAAAAAAAAAAAAAAAAAAAwAAAAEAAAADwAAAAYAAAANAAAACwAAAAgAAAAMAAAAAAAAAAAAAAAAAAAAAAAAAAMAAAAGAAAADwAAAAQAAAANAAAADAAAAA4AAAALAAAAAAAAAAAAAAAAAAAAAAAAAAgAAAABAAAADAAAAAUAAAABAAAACAAAAAcAAAAFAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAKAAAAAQAAAAgAAAAHAAAAAAAAAAIAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAwAAAALAAAAAwAAAAUAAAAIAAAABgAAAA4AAAAFAAAAAAAAAAAAAAAAAAAAAAAAAAEAAAANAAAADgAAAAAAAAAPAAAACQAAAAcAAAAEAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAJAAAAAgAAAAMAAAADAAAACgAAAA0AAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAgAAAAKAAAAAwAAAAYAAAABAAAAAgAAAA4AAAAMAAAAAAAAAAAAAAAAAAAAAAAAAAkAAAAAAAAACgAAAA0AAAACAAAABAAAAAMAAAAPAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAAAAAAAwAAAAEAAAAAAAAABAAAAA4AAAAHAAAAAAAAAAAAAAAAAAAAAAAAAAkAAAAAAAAACgAAAA0AAAACAAAABAAAAAMAAAAPAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAAAAAAAwAAAAEAAAAAAAAABAAAAA4AAAAHAAAA"}, "expected_experts": {"1": [[1, 8, 13, 14], [4, 6, 12, 15], [3, 4, 6, 15], [1, 5, 8, 12], [1, 7, 8, 10], [3, 5, 11, 12], [0, 1, 13, 14], [2, 3, 9, 15], [3, 6, 8, 10], [0, 9, 10, 13], [0, 1, 3, 7], [0, 9, 10, 13], [0, 1, 3, 7]], "2": [[1, 7, 9, 15], [8, 11, 12, 13], [11, 12, 13, 14], [1, 5, 7, 8], [0, 1, 2, 7], [5, 6, 8, 14], [4, 7, 9, 15], [3, 10, 13, 14], [1, 2, 12, 14], [2, 3, 4, 15], [0, 4, 7, 14], [2, 3, 4, 15], [0, 4, 7, 14]]}}, "first": {"input_ids": [5, 17, 42, 99, 123, 7, 250, 31, 64, 11], "output_ids": [60, 210, 53, 86], "start_len": 0, "meta_info": {"routed_experts": "AAAAAAAAAAAAAAAAAAAAAAAAAAABAAAABQAAAA0AAAAEAAAABwAAAAUAAAAPAAAAAAAAAAAAAAAAAAAAAAAAAAQAAAAIAAAACgAAAAsAAAACAAAAAQAAAAsAAAAGAAAAAAAAAAAAAAAAAAAAAAAAAAoAAAAAAAAAAwAAAAcAAAAOAAAABAAAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAoAAAAHAAAABQAAAAYAAAAAAAAABQAAAAIAAAAMAAAAAAAAAAAAAAAAAAAAAAAAAAkAAAAEAAAAAgAAAAoAAAADAAAACwAAAAoAAAACAAAAAAAAAAAAAAAAAAAAAAAAAAkAAAAAAAAACgAAAA0AAAACAAAABAAAAAMAAAAPAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAABAAAABwAAAAMAAAAMAAAABwAAAAAAAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAANAAAAAgAAAAoAAAAKAAAADAAAAA8AAAACAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAANAAAAAwAAAAsAAAAEAAAADgAAAA8AAAAGAAAAAAAAAAAAAAAAAAAAAAAAAAcAAAAJAAAADQAAAAUAAAAPAAAAAAAAAAMAAAAFAAAAAAAAAAAAAAAAAAAAAAAAAA4AAAAHAAAAAwAAAAUAAAAJAAAAAAAAAA4AAAAFAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAABAAAABQAAAAkAAAAFAAAABwAAAA0AAAADAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAJAAAAAgAAAAMAAAADAAAACgAAAA0AAAAOAAAA"}}, "continued": {"input_ids": [5, 17, 42, 99, 123, 7, 250, 31, 64, 11, 60, 210, 53, 86], "output_ids": [93, 250, 257, 210, 53, 86], "start_len": 12, "meta_info": {"routed_experts": "AAAAAAAAAAAAAAAAAAAAAA8AAAAJAAAAAgAAAAMAAAADAAAACgAAAA0AAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAgAAAAKAAAAAwAAAAYAAAABAAAAAgAAAA4AAAAMAAAAAAAAAAAAAAAAAAAAAAAAAAQAAAALAAAADAAAAAkAAAALAAAABgAAAAgAAAADAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAABAAAABwAAAAMAAAAMAAAABwAAAAAAAAAOAAAAAAAAAAAAAAAAAAAAAAAAAAQAAAAKAAAAAwAAAAsAAAACAAAADgAAAAsAAAAGAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAABAAAABQAAAAkAAAAFAAAABwAAAA0AAAADAAAAAAAAAAAAAAAAAAAAAAAAAA8AAAAJAAAAAgAAAAMAAAADAAAACgAAAA0AAAAOAAAA"}}, "hf_config": {"num_hidden_layers": 3, "n_routed_experts": 16, "num_experts_per_tok": 4, "first_k_dense_replace": 1}, "source": "SGLang 0.5.23 CPU, engine preset a, tiny GLM-4.5 'random' seed 0, tiny_model BUILDER_VERSION 1 (VOCAB 300)"}
""")


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
