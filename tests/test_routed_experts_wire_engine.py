"""The plugin's compact routed experts on REAL CPU engines (tiny GLM-4.5: 1 dense + 2 MoE layers, 16 experts,
top-4): the same greedy requests asked both ways give identical rows, whole and continued
(`routed_experts_start_len`), on 0.5.23 (configuration (b), DP rank 1 of (c)) and on 0.5.15.post1 (+slime)
in their environments (this file's `__main__` is the child there); stock requests keep SGLang's int32
format; the manager asks for compact after its admission probe. Prints the wire bytes per token both ways.
"""
import asyncio
import json
import os
import subprocess
import sys

import pytest
import requests

from rollout.net import auth_headers
from rollout.routed_experts import (MoELayout, decode_int32, encode_sglang, engine_offers, expand, opt_in,
                                    sample_routed_experts)
from sglang_patches.features.routed_experts_wire import LAYOUT_KEY

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
LAY = MoELayout.from_first_k_dense(3, 1, 16, 4)   # rollout/models/tiny.py
PROMPTS = [[11 + (7 * j) % 200 for j in range(12)], [5 + (13 * j) % 190 for j in range(20)]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gen(engine, ids, n, compact, **extra):
    sp = {"max_new_tokens": n, "temperature": 0}
    body = {"input_ids": list(ids), "sampling_params": opt_in(sp) if compact else sp, "return_routed_experts": True,
            "return_logprob": True, **extra}
    r = requests.post(engine.url + "/generate", headers=auth_headers(engine.api_key), json=body, timeout=300)
    assert r.status_code == 200, r.text[:300]
    return r.json(), len(r.content)


def compare_formats(engine, dp_rank=None) -> dict:
    """Every check against one engine; returns wire bytes per token both ways."""
    extra = {} if dp_rank is None else {"routed_dp_rank": dp_rank}
    info = requests.get(engine.url + "/server_info", headers=auth_headers(engine.api_key), timeout=60).json()
    assert engine_offers(info, LAY) == (True, ""), engine_offers(info, LAY)
    sizes = {"int32": [0, 0, 0], "compact": [0, 0, 0]}   # routed_experts chars, HTTP body bytes, rows
    for ids in PROMPTS:
        got = {}
        for fmt in ("int32", "compact"):
            out, body = _gen(engine, ids, 8, fmt == "compact", **extra)
            mi = out["meta_info"]
            tokens = len(ids) + len(mi["output_token_logprobs"])
            if fmt == "int32":   # SGLang's own format: no layout, base64 int32 of every layer
                assert LAYOUT_KEY not in mi
                assert decode_int32(mi["routed_experts"]).size == (tokens - 1) * LAY.num_hidden_layers * LAY.topk
            else:
                assert mi[LAYOUT_KEY]["rows"] == tokens - 1 and mi[LAYOUT_KEY]["dtype"] == "uint8", mi[LAYOUT_KEY]
            arr, why = sample_routed_experts(mi, tokens, LAY)
            assert why is None, f"{fmt}: {why}"
            if fmt == "int32":   # byte for byte what SGLang encodes for these rows (dense layers as zeros)
                assert mi["routed_experts"] == encode_sglang(expand(arr, LAY))
            got[fmt] = (out["output_ids"], arr)
            for i, v in enumerate((len(mi["routed_experts"]), body, tokens - 1)):
                sizes[fmt][i] += v
        assert got["int32"][0] == got["compact"][0]
        assert (got["int32"][1] == got["compact"][1]).all(), "rows differ between the formats"
        # a continued sample: 4 tokens, then the rest with routed_experts_start_len = the rows held
        whole = got["int32"][1]
        for fmt in ("int32", "compact"):
            first, _ = _gen(engine, ids, 4, fmt == "compact", **extra)
            head = first["output_ids"]
            held, why = sample_routed_experts(first["meta_info"], len(ids) + len(head), LAY)
            assert why is None, why
            start = held.shape[0]
            more, _ = _gen(engine, list(ids) + head, 8 - len(head), fmt == "compact", routed_experts_start_len=start,
                           **extra)
            tokens = len(ids) + len(head) + len(more["meta_info"]["output_token_logprobs"])
            arr, why = sample_routed_experts(more["meta_info"], tokens, LAY, held=held, start_len=start)
            assert why is None, f"{fmt} continued: {why}"
            assert head + more["output_ids"] == got["int32"][0] and (arr == whole).all(), f"{fmt}: continued rows differ"
    per = {f: {"routed_experts_b64": s[0] / s[2], "http_body": s[1] / s[2]} for f, s in sizes.items()}
    print(f"wire bytes per token (tiny model, {sizes['int32'][2]} rows): {json.dumps(per)}")
    return per


def test_compact_rows_equal_int32_rows(engine_pool, tiny_match_model):
    from support.engines import preset

    eng = engine_pool.get("b", preset("b", tiny_match_model))   # the same engine as test_engine_single
    per = compare_formats(eng)
    assert per["compact"]["routed_experts_b64"] < per["int32"]["routed_experts_b64"] / 5   # 2 of 3 layers, 1 B


def test_manager_asks_compact_after_its_probe(engine_pool, tiny_match_model):
    from support.engines import preset

    from rollout.manager import RolloutManager, RolloutOptions, engine_source
    from rollout.types import Endpoint, Sample

    eng = engine_pool.get("b", preset("b", tiny_match_model))

    async def run(force_int32):
        mgr = RolloutManager(engine_source(endpoints=[Endpoint("e0", eng.url, eng.api_key)]),
                             RolloutOptions({"max_new_tokens": 8, "temperature": 0}, 1, 2, layout=LAY))
        async with mgr:
            if force_int32:
                mgr.dispatcher.slots["e0"].compact = False
            s = await mgr.generate(Sample("g/0", "g", 0, PROMPTS[1]))
            return mgr.routed_formats["e0"], s
    fmt, s = asyncio.run(run(False))
    _, ref = asyncio.run(run(True))
    assert fmt == "routed experts: compact" and s.error is None and ref.error is None
    assert s.response_ids == ref.response_ids and (s.routed_experts == ref.routed_experts).all()


@pytest.mark.timeout(1500)
def test_compact_on_dp_rank_1_of_c(engine_pool, tiny_match_model):
    from support.engines import preset

    compare_formats(engine_pool.get("c", preset("c", tiny_match_model)), dp_rank=1)


def run_child(model: str, budget_s: float) -> dict:
    import tempfile

    from support.engines import preset, start_engine, stop_engine

    eng = start_engine(preset("a", model), tempfile.mkdtemp(prefix="engine-wire-"), budget_s)
    try:
        return compare_formats(eng)
    finally:
        assert not stop_engine(eng)[1], "engine processes left"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", ["0.5.15.post1", "0.5.15.post1+slime"])
def test_compact_rows_equal_int32_rows_on_slime_release(tiny_match_model, variant):
    from support.engines import ENGINE_BUDGET_S
    from support.variant_runs import python_of

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    p = subprocess.run([str(python_of(variant)), __file__, tiny_match_model, str(ENGINE_BUDGET_S)], env=env,
                       capture_output=True, text=True, timeout=ENGINE_BUDGET_S + 600)
    assert p.returncode == 0, p.stderr[-3000:]
    print(p.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(run_child(sys.argv[1], float(sys.argv[2]))))
