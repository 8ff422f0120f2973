"""Guard: padding rows captured as routes (sglang#36404) do not reach a request's payload in 0.5.23.

0.5.23 still captures top-k in `_post_process_topk_ids` BEFORE the padded-region mask, so the
device capture buffer holds the padding tokens' routes. What reaches a request is decided by the
host copy: `on_forward_end` writes the local slice to `host_cache[out_cache_loc]`, MLP-sync
padding pads `out_cache_loc` with zeros (`_pad_tensor_to_size`), and slot 0 is the KV pool's
reserved padding slot (`TokenToKVPoolAllocator` hands out 1..size). `get_topk` reads a request's
`req_to_token` slots only, so padded rows land in slot 0 and never in a payload.

Real SGLang code throughout (MLP-sync padding, the capture site, the capturer's host copy,
`get_topk`, the allocator); only the DP context is simulated, as in `dp_scenarios.py`.
End to end, `tests/test_engine_dp.py::test_c_every_dp_rank_matches_transformers` (e2e) checks
every DP rank's routes against transformers on configuration (c), where attn_tp alignment pads.
"""
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

topk = pytest.importorskip("sglang.srt.layers.moe.topk")

from dp_scenarios import _capturer, _dp_context, _prepare  # noqa: E402  (tests/ is on sys.path)

PAD_ROUTE = [7, 9]  # what the router makes of a padding token (input id 0, position 0)


def test_padding_rows_capture_guard():
    fb, err = _prepare(bs=1, k=3, attn_tp=8)  # 3 real verify rows padded to attn_tp 8 by SGLang
    assert err is None, err
    assert fb.out_cache_loc.shape[0] == 8 and fb.out_cache_loc[3:].eq(0).all()
    fb.out_cache_loc[:3] += 100  # this request's KV slots (the padding stays SGLang's zeros)
    fb.out_cache_loc_virtual = None
    real = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    ids = torch.cat([real, torch.tensor(PAD_ROUTE, dtype=torch.int32).expand(5, 2)])
    cap = _capturer(rows=8)
    with ExitStack() as stack:
        _dp_context(stack, dp_rank=0, dp_size=1)
        stack.enter_context(mock.patch.object(topk, "get_global_experts_capturer", lambda: cap))
        moe_ids = topk._post_process_topk_ids(ids.clone(), torch.ones(8, 2), topk.TopKConfig(top_k=2),
                                              router_logits=None, layer_id=0,
                                              num_token_non_padded=torch.tensor(3))[0]
        cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None)

    # The defect's first half is present in 0.5.23: capture before the mask.
    assert cap.device_cache.buffer[3:8, 0].tolist() == [PAD_ROUTE] * 5
    assert moe_ids[3:].eq(-1).all() and torch.equal(moe_ids[:3], real)
    # Host copy: real rows to the request's slots, padding rows to the reserved slot 0.
    assert cap.host_cache.buffer[100:103, 0].tolist() == real.tolist()
    assert cap.host_cache.buffer[0, 0].tolist() == PAD_ROUTE
    # The payload: get_topk over the request's req_to_token slots.
    pool = SimpleNamespace(req_to_token=torch.tensor([[100, 101, 102, 103]]))
    assert cap.get_topk(0, 4, pool).reshape(3, 2).tolist() == real.tolist()

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    alloc = TokenToKVPoolAllocator(size=16, dtype=torch.int64, device="cpu", kvcache=None, need_sort=False)
    assert 0 not in alloc.alloc(16).tolist() and alloc.alloc(1) is None  # slot 0 is never a request's
