"""Guard: padding rows captured as routes (sglang#36404) do not reach a request's payload.

SGLang 0.5.23 (and 0.5.15.post1, 0.5.16) still capture top-k in `_post_process_topk_ids` BEFORE the
padded-region mask, so the device capture buffer holds the padding tokens' routes. What reaches a
request is decided by the host copy: `on_forward_end` writes this DP rank's slice of the gathered
buffer to `host_cache[out_cache_loc]`; MLP-sync padding pads `out_cache_loc` with zeros
(`_pad_tensor_to_size`), and slot 0 is the KV pool's reserved padding slot
(`TokenToKVPoolAllocator` hands out 1..size). `get_topk` reads a request's `req_to_token` slots
only, so padded rows land in slot 0 and never in a payload.

Real SGLang code throughout (the capture site, the capturer's DP slice and host copy, the padding
helper, `get_topk`, the allocator); only the DP context is simulated (DP rank 1 of 2). Runs on every
reviewed version's environment. End to end, `tests/test_engine_dp.py::
test_c_every_dp_rank_matches_transformers` (e2e) checks every DP rank's routes against transformers
on configuration (c), where attn_tp alignment pads.
"""
import inspect
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from sglang_patches.scenarios.dp import _capturer

topk = pytest.importorskip("sglang.srt.layers.moe.topk")

PAD_ROUTE = [7, 9]  # what the router makes of a padding token (input id 0, position 0)


def _dp_rank(stack, rank, width):
    import sglang.srt.layers.dp_attention as dpa
    import sglang.srt.state_capturer.routed_experts as re_mod

    if hasattr(dpa, "dp_slot_in"):  # 0.5.23
        stack.enter_context(mock.patch.object(dpa, "dp_gather_width", lambda: width))
        stack.enter_context(mock.patch.object(dpa, "dp_gather_slot", lambda: rank))
        stack.enter_context(mock.patch.object(re_mod, "_is_scattered_a2a_backend", lambda: False))
    else:  # 0.5.15.post1, 0.5.16
        stack.enter_context(mock.patch.object(dpa, "get_attention_dp_rank", lambda: rank))
        stack.enter_context(mock.patch.object(re_mod, "get_moe_a2a_backend",
                                              lambda: SimpleNamespace(is_deepep=lambda: False)))
    stack.enter_context(mock.patch.object(re_mod, "is_dp_attention_enabled", lambda: True))


def test_padding_rows_capture_guard():
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    # MLP-sync padding of out_cache_loc, as SGLang's own source does it.
    assert "self.out_cache_loc = self._pad_tensor_to_size(self.out_cache_loc, num_tokens)" \
        in inspect.getsource(ForwardBatch)
    slots = ForwardBatch._pad_tensor_to_size(None, torch.tensor([100, 101, 102]), 8)  # 3 real -> 8
    fb = SimpleNamespace(global_num_tokens_cpu=[8, 8], out_cache_loc=slots, out_cache_loc_virtual=None)
    real = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    pad = torch.tensor(PAD_ROUTE, dtype=torch.int32).expand(5, 2)
    rank0 = torch.tensor([[10, 11]], dtype=torch.int32).expand(8, 2)
    gathered = torch.cat([rank0, real, pad])  # DP-gathered batch: rank 0's 8 rows, then ours
    cap = _capturer(rows=16)
    with ExitStack() as stack:
        _dp_rank(stack, rank=1, width=2)
        stack.enter_context(mock.patch.object(topk, "get_global_experts_capturer", lambda: cap))
        moe_ids = topk._post_process_topk_ids(gathered.clone(), torch.ones(16, 2), topk.TopKConfig(top_k=2),
                                              router_logits=None, layer_id=0,
                                              num_token_non_padded=torch.tensor(11))[0]
        cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None)

    # The defect's first half is present: the padding rows' routes are captured (the MoE got -1).
    assert cap.device_cache.buffer[11:16, 0].tolist() == [PAD_ROUTE] * 5
    assert torch.equal(moe_ids[8:11], real)
    from importlib.metadata import version
    masked_on_cpu = version("sglang") not in ("0.5.15.post1", "0.5.16")  # those mask on CUDA (HIP) only
    assert moe_ids[11:].eq(-1).all() == masked_on_cpu
    # Host copy: our real rows to the request's slots, our padding rows to the reserved slot 0.
    assert cap.host_cache.buffer[100:103, 0].tolist() == real.tolist()
    assert cap.host_cache.buffer[0, 0].tolist() == PAD_ROUTE
    # The payload: get_topk over the request's req_to_token slots.
    pool = SimpleNamespace(req_to_token=torch.tensor([[100, 101, 102, 103]]))
    assert cap.get_topk(0, 4, pool).reshape(3, 2).tolist() == real.tolist()

    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    alloc = TokenToKVPoolAllocator(size=16, dtype=torch.int64, device="cpu", kvcache=None, need_sort=False)
    assert 0 not in alloc.alloc(16).tolist() and alloc.alloc(1) is None  # slot 0 is never a request's
