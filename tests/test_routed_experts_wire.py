"""The compact routed-experts wire format (plugin feature `compact-routed-experts`): engine-side encode,
the tokenizer hop's header split, the client's checks, and what stock requests get (no engine here;
tests/test_routed_experts_wire_engine.py runs real engines)."""
import asyncio
from types import SimpleNamespace

import numpy as np
import pybase64
import pytest
import torch

from rollout.routed_experts import MoELayout, decode_compact, engine_offers, opt_in, sample_routed_experts, wire_layout
from support.synthetic import synthetic_full
from sglang_patches.features import routed_experts_wire as w

GLM = MoELayout.from_first_k_dense(92, 3, 160, 8)
GLM_CFG = {"num_hidden_layers": 92, "num_experts_per_tok": 8, "n_routed_experts": 160, "first_k_dense_replace": 3}


def wire_answer(full, layout, start_len=0):
    """meta_info of a compact answer, as the engine's three hops make it."""
    t = w.encode(torch.from_numpy(full), wire_layout(layout), start_len)
    assert t is not None and t.dtype == torch.uint8
    got = w.split_b64(pybase64.b64encode(t.numpy().tobytes()).decode())
    return {"routed_experts": got[1], w.LAYOUT_KEY: got[0]}


@pytest.mark.parametrize("layout", [GLM, MoELayout.from_first_k_dense(3, 1, 16, 4),
                                    MoELayout(6, (1, 2, 4), 300, 2)])   # int16, non-contiguous layers
def test_compact_rows_equal_the_int32_rows(layout):
    full = synthetic_full(37, layout, seed=1)
    arr, why = sample_routed_experts(wire_answer(full, layout), 38, layout)
    assert why is None and arr.dtype == layout.compact_dtype
    np.testing.assert_array_equal(arr, decode_compact(pybase64.b64encode(full.tobytes()).decode(), layout, 38))


def test_glm_wire_bytes_per_token_and_layout_from_config():
    assert w.engine_layout(GLM_CFG) == wire_layout(GLM)
    meta = wire_answer(synthetic_full(300, GLM), GLM)
    assert len(meta["routed_experts"]) / 300 == pytest.approx(712 * 4 / 3)
    assert meta[w.LAYOUT_KEY] == {**wire_layout(GLM), "rows": 300, "start_len": 0}


def test_engine_layout_conventions():
    qwen = {"num_hidden_layers": 4, "num_experts_per_tok": 2, "num_experts": 8, "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}
    assert w.engine_layout(qwen)["moe_layers"] == [[1, 2]]
    assert w.engine_layout({"num_hidden_layers": 4, "num_experts_per_tok": 2}) is None   # dense model


def test_partial_rollout_segment():
    full = synthetic_full(20, GLM, seed=2)
    held, _ = sample_routed_experts(wire_answer(full[:12], GLM), 13, GLM)
    arr, why = sample_routed_experts(wire_answer(full[8:], GLM, 8), 21, GLM, held=held, start_len=8)
    assert why is None
    np.testing.assert_array_equal(arr, full[:, 3:])


@pytest.mark.parametrize("change,value", [(3, 1), (5, 160), (5, -1)])
def test_engine_keeps_int32_when_compacting_would_hide_something(change, value):
    full = synthetic_full(4, GLM)
    full[2, 1 if change == 3 else 5, 0] = value   # a dense layer with ids, an id out of range
    assert w.encode(torch.from_numpy(full), wire_layout(GLM)) is None


def _mutate(meta, fn):
    raw = bytearray(pybase64.b64decode(meta["routed_experts"]))
    fn(raw)
    return {**meta, "routed_experts": pybase64.b64encode(bytes(raw)).decode()}


@pytest.mark.parametrize("bad,needle", [
    (lambda m: {**m, w.LAYOUT_KEY: {**m[w.LAYOUT_KEY], "moe_layers": [[2, 92]]}},
     "routed_experts_layout moe_layers=[[2, 92]] does not match the model's [[3, 92]]"),
    (lambda m: {**m, w.LAYOUT_KEY: {**m[w.LAYOUT_KEY], "dtype": "int16"}}, "dtype='int16' does not match"),
    (lambda m: {**m, w.LAYOUT_KEY: {**m[w.LAYOUT_KEY], "rows": 9}}, "routed_experts_layout says 9 rows, the payload holds 5"),
    (lambda m: {**m, "routed_experts": m["routed_experts"][:-4]}, "not whole rows of 712"),
    (lambda m: {**m, "routed_experts": "*" + m["routed_experts"][1:]}, "not valid base64"),
    (lambda m: _mutate(m, lambda r: r.__setitem__(712 + 3, 200)), "expert id 200 >= num_experts=160 at token 1, layer 3"),
    (lambda m: _mutate(m, lambda r: r.__setitem__(1, r[0])), "duplicate expert id in top-k"),
    (lambda m: _mutate(m, lambda r: r.__setitem__(slice(0, 8), bytes(8))), "MoE layer 3 has no routing (all zeros) at token 0"),
    (lambda m: {**m, w.LAYOUT_KEY: "x"}, "routed_experts_layout is a str, expected a dict"),
])
def test_bad_compact_payload_gives_one_line_reason(bad, needle):
    meta = bad(wire_answer(synthetic_full(5, GLM, seed=3), GLM))
    arr, why = sample_routed_experts(meta, 6, GLM)
    assert arr is None and needle in why and "\n" not in why


def test_row_count_and_half_patched_engine():
    meta = wire_answer(synthetic_full(5, GLM), GLM)
    assert "has 5 rows, expected len(tokens)-1-start_len=3" in sample_routed_experts(meta, 4, GLM)[1]
    t = w.encode(torch.from_numpy(synthetic_full(5, GLM)), wire_layout(GLM))
    unsplit = {"routed_experts": pybase64.b64encode(t.numpy().tobytes()).decode()}
    assert "compact header but meta_info has no routed_experts_layout" in sample_routed_experts(unsplit, 6, GLM)[1]


def test_scheduler_hook_compacts_only_requests_that_opt_in():
    full = torch.from_numpy(synthetic_full(3, GLM))
    proc = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**GLM_CFG)))
    stock = SimpleNamespace(routed_experts=full, sampling_params=SimpleNamespace(custom_params=None))
    other = SimpleNamespace(routed_experts=full, sampling_params=SimpleNamespace(custom_params={"x": 1}))
    asked = SimpleNamespace(routed_experts=full, routed_experts_start_len=0,
                            sampling_params=SimpleNamespace(custom_params={w.OPT_IN_KEY: w.OPT_IN_VALUE}))
    for req in (stock, other, asked):
        w.compact_collected(None, proc, req)
    assert stock.routed_experts is full and other.routed_experts is full
    assert asked.routed_experts.dtype == torch.uint8 and asked.routed_experts.numel() < full.numel() * 4 // 3


def test_tokenizer_hook_leaves_stock_streams_alone_and_splits_compact_ones():
    sentinel = object()
    stock = SimpleNamespace(sampling_params={"max_new_tokens": 2})
    assert w.split_layout(lambda self, obj, request=None: sentinel, None, stock) is sentinel
    meta = {"routed_experts": pybase64.b64encode(w.encode(torch.from_numpy(synthetic_full(2, GLM)),
                                                         wire_layout(GLM)).numpy().tobytes()).decode()}

    async def gen(self, obj, request=None):
        yield {"meta_info": meta}

    asked = SimpleNamespace(sampling_params=opt_in({"max_new_tokens": 2}))

    async def first():
        return [out async for out in w.split_layout(gen, None, asked)]
    out = asyncio.run(first())[0]["meta_info"]
    assert out[w.LAYOUT_KEY]["rows"] == 2 and len(pybase64.b64decode(out["routed_experts"])) == 2 * 712


def test_advert_and_probe():
    async def states(self):
        return [{"a": 1}, {"a": 2}]
    tm = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**GLM_CFG)))
    info = {"internal_states": asyncio.run(w.advertise(states, tm))}
    assert engine_offers(info, GLM) == (True, "")
    ok, why = engine_offers(info, MoELayout.from_first_k_dense(92, 1, 160, 8))
    assert not ok and "moe_layers=[[3, 92]] differs from the model's [[1, 92]]" in why
    assert engine_offers({"internal_states": [{}]}, GLM) == (False, "compact routed experts not advertised "
                                                                     "(no plugin feature on this engine)")
    assert opt_in({"custom_params": {"return_top_p_token_ids": True}})["custom_params"] == {
        "return_top_p_token_ids": True, w.OPT_IN_KEY: w.OPT_IN_VALUE}


def test_real_sglang_detokenizer_encodes_the_compact_bytes_and_takes_the_opt_in():
    """Facts of the installed SGLang the feature rests on: the detokenizer hop base64-encodes any tensor's
    bytes (no hook needed there), and the opt-in is a valid custom param."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams

    t = torch.arange(12, dtype=torch.uint8)
    assert DetokenizerManager._b64_encode_per_request([t, None]) == [pybase64.b64encode(bytes(range(12))).decode(), None]
    sp = SamplingParams(max_new_tokens=2, **{k: v for k, v in opt_in({}).items()})
    sp.verify(vocab_size=100)
    assert w.wants_compact(sp.custom_params)


def test_slime_compact_expands_and_refuses_unreviewed_slime(monkeypatch, capsys, tmp_path):
    """rollout.routed_experts.slime_compact without slime: the expansion, and a changed slime function is
    left alone with one stderr line (tests/test_slime_real.py and scripts/check_against_slime.sh run it on
    slime's own code)."""
    from rollout.routed_experts import slime_compact as sc

    args = SimpleNamespace(num_layers=3, moe_layer_freq=[0, 1, 1], num_experts=16, moe_router_topk=4)
    lay = sc.layout_from_args(args)
    full = synthetic_full(5, lay)
    compact = torch.from_numpy(np.ascontiguousarray(full[:, 1:].astype(np.uint8)))
    assert torch.equal(sc.to_slime(compact, lay), torch.from_numpy(full))
    handed = sc.for_slime(compact.numpy())
    assert handed.shape == (5, 8) and torch.equal(sc.to_slime(handed, lay), torch.from_numpy(full))
    assert sc.to_slime(torch.from_numpy(full), lay).dtype == torch.int32
    assert [x.shape for x in sc._Expanded([compact, compact], lay)] == [(5, 3, 4)] * 2
    (tmp_path / "slime_rollout_changed.py").write_text(
        "def validate_rollout_routed_experts_for_replay(routed_experts, args):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sc, "ROLLOUT_DATA", "slime_rollout_changed")   # where slime defines it
    assert sc.install_rollout_side() is False
    import slime_rollout_changed
    assert not hasattr(slime_rollout_changed.validate_rollout_routed_experts_for_replay, "__wrapped__")
    assert "routed experts handed to slime as int32: source of slime_rollout_changed." \
           "validate_rollout_routed_experts_for_replay changed (fingerprint" in capsys.readouterr().err
