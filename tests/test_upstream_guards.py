"""Guards for three changes proposed in sglang#26016 that SGLang 0.5.23 already handles.

These pass on stock 0.5.23 and fail if SGLang regresses, or if someone "ports" the proposed change.
No plugin is loaded in this process.
"""
from types import SimpleNamespace

import pytest
import torch

from sglang_patches.scenarios.guards import health_generate_codes, verify_logits_rows

dpa = pytest.importorskip("sglang.srt.layers.dp_attention")


def _dp(monkeypatch, width, slot):
    monkeypatch.setattr(dpa, "dp_gather_width", lambda: width)
    monkeypatch.setattr(dpa, "dp_gather_slot", lambda: slot)


def test_dp_buffer_sizing_guard(monkeypatch):
    """dp-buffer-sizing: with only the attn-TP gather, per-rank lists have one entry, resolved by dp_slot_in."""
    from sglang.srt.model_executor import forward_batch_info as fbi

    _dp(monkeypatch, width=4, slot=3)  # attn_dp_size 4, this process is DP rank 3
    assert dpa.dp_slot_in([16]) == 0
    with pytest.raises(ValueError):
        dpa.dp_slot_in([16, 8])  # the length contract: 1 or the gather width
    assert dpa.dp_slot_in([16, 8, 8, 8]) == 3

    # set_local_num_token_non_padded reads this rank's own count from the one-entry list.
    # Porting the proposed change would hand it the 4-entry gathered list and it would read entry 0.
    monkeypatch.setattr("sglang.srt.utils.common.require_mlp_tp_gather", lambda: False)
    monkeypatch.setattr(fbi, "_attn_tp_local_shard_bounds", lambda n, sharded: (n, 0))
    fb = SimpleNamespace(global_num_tokens_cpu=[16], global_num_token_non_padded=torch.tensor(12))
    fbi.ForwardBatch.set_local_num_token_non_padded(fb, sharded=True)
    assert int(fb.num_token_non_padded) == 12  # clamp(12, 0, 16): bounded by this rank's 16

    ported = SimpleNamespace(global_num_tokens_cpu=[8, 8, 8, 16], global_num_token_non_padded=torch.tensor(12))
    fbi.ForwardBatch.set_local_num_token_non_padded(ported, sharded=True)
    assert int(ported.num_token_non_padded) == 8  # what the ported change would do: rank 0's width


def test_verify_logits_truncation_guard():
    """verify-logits-truncation: post_forward_mlp_sync_batch already cuts padded verify logits to bs * k rows."""
    assert verify_logits_rows() == (12, 12)


def test_heartbeat_reset_guard():
    """heartbeat-reset: /health_generate needs a message received after the probe started, so resetting
    last_receive_tstamp before "fired up" cannot change its answer: an ancient stamp plus a reply is 200,
    an ancient or a "just reset" stamp without one is 503."""
    from sglang.srt.entrypoints import http_server

    disagg = SimpleNamespace(disaggregation_mode="null")
    assert health_generate_codes([("get_disagg", lambda: disagg)]) == (200, 503, 503)
    assert hasattr(http_server, "get_disagg")  # 0.5.23 reads the mode here, not from server_args
