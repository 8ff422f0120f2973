"""Guards for seed-000 fixes 1, 3 and 4, which SGLang 0.5.23 already handles.

These pass on stock 0.5.23 and fail if SGLang regresses, or if someone "ports" the seed fix.
No plugin is loaded in this process.
"""
import asyncio
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

dpa = pytest.importorskip("sglang.srt.layers.dp_attention")


def _dp(monkeypatch, width, slot):
    monkeypatch.setattr(dpa, "dp_gather_width", lambda: width)
    monkeypatch.setattr(dpa, "dp_gather_slot", lambda: slot)


def test_dp_buffer_sizing_guard(monkeypatch):
    """Fix 1: with only the attn-TP gather, per-rank lists have one entry, resolved by dp_slot_in."""
    from sglang.srt.model_executor import forward_batch_info as fbi

    _dp(monkeypatch, width=4, slot=3)  # attn_dp_size 4, this process is DP rank 3
    assert dpa.dp_slot_in([16]) == 0
    with pytest.raises(ValueError):
        dpa.dp_slot_in([16, 8])  # the length contract: 1 or the gather width
    assert dpa.dp_slot_in([16, 8, 8, 8]) == 3

    # set_local_num_token_non_padded reads this rank's own count from the one-entry list.
    # Porting the seed fix would hand it the 4-entry gathered list and it would read entry 0.
    monkeypatch.setattr("sglang.srt.utils.common.require_mlp_tp_gather", lambda: False)
    monkeypatch.setattr(fbi, "_attn_tp_local_shard_bounds", lambda n, sharded: (n, 0))
    fb = SimpleNamespace(global_num_tokens_cpu=[16], global_num_token_non_padded=torch.tensor(12))
    fbi.ForwardBatch.set_local_num_token_non_padded(fb, sharded=True)
    assert int(fb.num_token_non_padded) == 12  # clamp(12, 0, 16): bounded by this rank's 16

    ported = SimpleNamespace(global_num_tokens_cpu=[8, 8, 8, 16], global_num_token_non_padded=torch.tensor(12))
    fbi.ForwardBatch.set_local_num_token_non_padded(ported, sharded=True)
    assert int(ported.num_token_non_padded) == 8  # what the seed port would do: rank 0's width


def test_verify_logits_truncation_guard(monkeypatch):
    """Fix 3: post_forward_mlp_sync_batch already cuts padded verify logits to bs * k rows."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=4, input_ids=torch.arange(16),
        req_pool_indices=torch.arange(4), seq_lens=torch.full((4,), 9), out_cache_loc=torch.arange(16),
        seq_lens_sum=36, spec_info=SimpleNamespace(num_tokens_per_req=4),
    )
    fb._original_batch_size = 3
    out = LogitsProcessorOutput(next_token_logits=torch.zeros(16, 7), hidden_states=torch.zeros(16, 5))
    fb.post_forward_mlp_sync_batch(out)
    assert out.next_token_logits.shape[0] == 12
    assert out.hidden_states.shape[0] == 12


def test_heartbeat_reset_guard(monkeypatch):
    """Fix 4: /health_generate needs a message received after the probe started, so resetting
    last_receive_tstamp before "fired up" cannot change its answer."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    def manager(stamp, bump):
        tm = SimpleNamespace(server_status=ServerStatus.Up, gracefully_exit=False, is_generation=True,
                             rid_to_state={}, last_receive_tstamp=stamp, server_args=SimpleNamespace())

        async def generate_request(obj, request=None):
            await asyncio.sleep(0.2)
            if bump:
                tm.last_receive_tstamp = time.time()
            yield {}

        tm.generate_request = generate_request
        return tm

    def probe(tm):
        req = SimpleNamespace(url=SimpleNamespace(path="/health_generate"), headers={})
        with mock.patch.object(http_server, "_global_state", SimpleNamespace(tokenizer_manager=tm)), \
                mock.patch.object(http_server, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null")), \
                mock.patch.object(http_server, "HEALTH_CHECK_TIMEOUT", 2):
            return asyncio.run(http_server.health_generate(req)).status_code

    assert probe(manager(0.0, bump=True)) == 200  # an ancient stamp does not cause a 503
    assert probe(manager(0.0, bump=False)) == 503
    assert probe(manager(time.time(), bump=False)) == 503  # a "just reset" stamp does not cause a 200
