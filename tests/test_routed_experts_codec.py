"""Routed experts: layout, codec round trips, partial-rollout merge, slime shape, replay packing."""
import numpy as np
import pytest
import torch

from rollout.routed_experts import (
    MoELayout, RoutedExpertsError, bytes_per_token, decode_compact, encode_sglang, expand, for_trainer,
    merge_segments, pack_replay_indices, sample_routed_experts, to_slime_shape,
)
from rollout.routed_experts import validate
from support.synthetic import synthetic_full

GLM45_HF = {"num_hidden_layers": 92, "n_routed_experts": 160, "num_experts_per_tok": 8, "first_k_dense_replace": 3}


def test_layout_from_hf_glm45():
    lay = MoELayout.from_hf_config(GLM45_HF)
    assert lay.num_moe_layers == 89 and lay.dense_layers == (0, 1, 2) and lay.moe_slice == slice(3, 92)
    assert lay.compact_dtype == np.uint8
    assert bytes_per_token(lay, True) == 712 and bytes_per_token(lay, False) == 2944


def test_layout_from_layer_freq_and_errors():
    lay = MoELayout.from_layer_freq([0] * 3 + [1] * 89, 160, 8)
    assert lay == MoELayout.from_first_k_dense(92, 3, 160, 8)
    assert MoELayout.from_layer_freq("[0]*3+[1]*89", 160, 8) == lay
    assert MoELayout.from_layer_freq("[0, 1,1]", 8, 2).moe_layers == (1, 2)
    with pytest.raises(RoutedExpertsError, match="cannot read moe_layer_freq"):
        MoELayout.from_layer_freq("__import__('os')", 8, 2)
    holes = MoELayout.from_layer_freq(2, 300, 4, num_hidden_layers=6)
    assert holes.moe_layers == (0, 2, 4) and holes.moe_slice is None and holes.compact_dtype == np.int16
    with pytest.raises(RoutedExpertsError, match="lacks 'num_experts_per_tok'"):
        MoELayout.from_hf_config({"num_hidden_layers": 4, "n_routed_experts": 8})
    with pytest.raises(RoutedExpertsError, match="topk=9"):
        MoELayout.from_first_k_dense(4, 1, 8, 9)


@pytest.mark.parametrize("num_experts,dtype", [(160, np.uint8), (256, np.uint8), (300, np.int16)])
@pytest.mark.parametrize("first_dense", [0, 2])
def test_round_trip_both_dtypes(num_experts, dtype, first_dense):
    lay = MoELayout.from_first_k_dense(7, first_dense, num_experts, 8)
    full = synthetic_full(40, lay, seed=num_experts)
    full[0, list(lay.moe_layers), :] = np.arange(num_experts - 8, num_experts)  # the largest ids survive
    comp = decode_compact(encode_sglang(full), lay, num_tokens=41)
    assert comp.dtype == dtype and comp.shape == (40, lay.num_moe_layers, 8) and comp.flags.c_contiguous
    np.testing.assert_array_equal(expand(comp, lay), full)


@pytest.mark.parametrize("kind", ["bytes", "list", "ndarray", "tensor", "bytearray"])
def test_other_payload_types(kind):
    lay = MoELayout.from_layer_freq([1, 0, 1, 1], 300, 3)  # non-contiguous MoE layers, int16
    full = synthetic_full(9, lay, seed=3)
    payload = {"bytes": full.tobytes(), "bytearray": bytearray(full.tobytes()), "list": full.tolist(),
               "ndarray": full.astype(np.int64), "tensor": torch.from_numpy(full)}[kind]
    np.testing.assert_array_equal(expand(decode_compact(payload, lay, 10), lay), full)


def test_many_blocks_match_single_block(monkeypatch):
    lay = MoELayout.from_first_k_dense(5, 1, 64, 4)
    full = synthetic_full(101, lay, seed=5)  # 101 rows: not a multiple of the block
    ref = decode_compact(encode_sglang(full), lay, 102)
    monkeypatch.setattr(validate, "BLOCK_BYTES", 5 * 4 * 4 * 7)  # 7 rows -> 6-row blocks
    np.testing.assert_array_equal(decode_compact(encode_sglang(full), lay, 102), ref)
    bad = full.copy()
    bad[97, 3, 2] = 64
    with pytest.raises(RoutedExpertsError, match="token 97, layer 3"):
        decode_compact(encode_sglang(bad), lay, 102)


def test_partial_rollout_merge():
    lay = MoELayout.from_first_k_dense(4, 1, 32, 4)
    whole = synthetic_full(29, lay, seed=7)  # 30 tokens in the end
    # Segment 1: 12 prompt + 8 output tokens -> rows [0, 19). Segment 2 re-sends from start_len=15.
    held, err = sample_routed_experts({"routed_experts": encode_sglang(whole[:19])}, 20, lay)
    assert err is None and held.shape[0] == 19
    meta = {"routed_experts": encode_sglang(whole[15:]), "routed_experts_start_len": 15}
    merged, err = sample_routed_experts(meta, 30, lay, held=held)
    assert err is None
    np.testing.assert_array_equal(expand(merged, lay), whole)
    # start_len passed by the caller (SGLang does not echo it in meta_info)
    merged2, err = sample_routed_experts({"routed_experts": encode_sglang(whole[15:])}, 30, lay, held, start_len=15)
    assert err is None and np.array_equal(merged2, merged)


def test_merge_errors():
    lay = MoELayout.from_first_k_dense(4, 1, 32, 4)
    new = decode_compact(encode_sglang(synthetic_full(5, lay)), lay, 6)
    with pytest.raises(RoutedExpertsError, match="no earlier segment"):
        merge_segments(None, new, 3)
    with pytest.raises(RoutedExpertsError, match="exceeds the 2 rows"):
        merge_segments(new[:2], new, 3)
    assert merge_segments(None, new, 0) is new


def test_slime_shape_switch():
    lay = MoELayout.from_first_k_dense(6, 2, 160, 8)
    full = synthetic_full(11, lay, seed=11)
    comp = decode_compact(encode_sglang(full), lay, 12)
    slime = for_trainer(comp, lay, compact_path=False)
    assert slime.dtype == torch.int32 and tuple(slime.shape) == (11, 6, 8)
    assert torch.equal(slime, torch.from_numpy(full)) and torch.equal(to_slime_shape(comp, lay), slime)
    small = for_trainer(comp, lay, compact_path=True)
    assert small.dtype == torch.uint8 and tuple(small.shape) == (11, 4, 8)
    assert small.numel() * small.element_size() * 4 < slime.numel() * slime.element_size()


def test_pack_replay_indices_slime_convention():
    lay = MoELayout.from_first_k_dense(4, 1, 16, 4)
    a, b = synthetic_full(6, lay, 1), synthetic_full(3, lay, 2)  # 7 and 4 tokens
    ca = decode_compact(encode_sglang(a), lay, 7)
    per_layer = pack_replay_indices([ca, torch.from_numpy(b)], lay, token_lengths=[7, 4], pad_to_multiple=8)
    assert len(per_layer) == 3 and all(t.dtype == torch.int64 and tuple(t.shape) == (16, 4) for t in per_layer)
    for j, t in enumerate(per_layer):
        assert torch.equal(t[:6], torch.from_numpy(a[:, j + 1]).long())
        assert torch.equal(t[7:10], torch.from_numpy(b[:, j + 1]).long())
        pads = t[[6, 10, 11, 12, 13, 14, 15]]  # 7 pad rows x 4 = 28 assignments over 16 experts
        assert all(len(set(r)) == 4 for r in pads.tolist())
        assert torch.bincount(pads.reshape(-1), minlength=16).tolist().count(2) == 12
    local = pack_replay_indices([ca], lay, local_moe_layers=[2])
    assert len(local) == 1 and torch.equal(local[0][:6], torch.from_numpy(a[:, 3]).long())
    with pytest.raises(RoutedExpertsError, match="sample 0: 6 routing rows for 6 tokens"):
        pack_replay_indices([ca], lay, token_lengths=[6])
