"""KV-pool and req_to_token bookkeeping ops (torch versions of sgl_kernel's CPU ops).

Semantics follow SGLang 0.5.23's Triton kernels of the same name:
kernels/ops/kvcache/cache_move.py, mem_cache/allocation.py,
kernels/ops/speculative/cache_locs.py. All ops write their outputs in place.
"""
import ctypes

import numpy as np
import torch

_U64 = (1 << 64) - 1


def _segments(start: torch.Tensor, end: torch.Tensor):
    """(start, end, packed offset) per request; offsets are the running sum of lengths."""
    starts = start.tolist()
    ends = end.tolist()
    off = 0
    for s, e in zip(starts, ends):
        yield s, e, off
        off += max(e - s, 0)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer i (raw address data_ptrs[i], row size strides[i] bytes):
    row[tgt_loc[j]] = row[src_loc[j]]. All sources are read before any write."""
    tgt = tgt_loc.to(torch.int64).reshape(-1)
    src = src_loc.to(torch.int64).reshape(-1)
    if tgt.numel() != src.numel():
        raise ValueError(f"copy_all_layer_kv_cache_cpu: {tgt.numel()} targets vs {src.numel()} sources")
    if tgt.numel() == 0:
        return
    rows = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        ptr &= _U64
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.from_numpy(np.ctypeslib.as_array(raw)).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing gathers a copy first: in-place safe


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[rpi[i], start[i]:end[i]] = packed segment i of out_cache_loc."""
    table = req_to_token.view(-1, pool_len)
    for row, (s, e, off) in zip(req_pool_indices.tolist(), _segments(start_offset, end_offset)):
        if e > s:
            table[row, s:e] = out_cache_loc[off : off + e - s].to(table.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Packed segment i of out_cache_loc = req_to_token[rpi[i], start[i]:end[i]]."""
    table = req_to_token.view(-1, pool_len)
    for row, (s, e, off) in zip(req_pool_indices.tolist(), _segments(start_offset, end_offset)):
        if e > s:
            out_cache_loc[off : off + e - s] = table[row, s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, speculative_num_steps):
    """out[i*n:(i+1)*n] = req_to_token[rpi[i], seq_lens[i]:seq_lens[i]+n], n = topk*steps."""
    n = topk * speculative_num_steps
    table = req_to_token.view(-1, pool_len)
    for i, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n : (i + 1) * n] = table[row, s : s + n].to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, speculative_num_steps, pool_len):
    """One req_to_token row per draft candidate (request b, branch k -> row b*topk+k):
    the request's prefix [0, seq_len), then that branch's draft slots
    req_to_token[rpi, seq_len + k*steps + s] for s in [0, steps); zeros after.
    The slot layout is the one SGLang's `generate_draft_decode_kv_indices`
    (cache_locs.py) reads for page_size 1, matching assign_draft_cache_locs."""
    table = req_to_token.view(-1, pool_len)
    bs = seq_lens.numel()
    out = torch.zeros((bs * topk, pool_len), dtype=table.dtype, device=table.device)
    steps = speculative_num_steps
    for b, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for k in range(topk):
            r = b * topk + k
            draft = table[row, s + k * steps : s + (k + 1) * steps]
            out[r, :s] = table[row, :s]
            out[r, s : s + draft.numel()] = draft
    return out
