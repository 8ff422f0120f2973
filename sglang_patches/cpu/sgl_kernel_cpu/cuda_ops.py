"""Torch versions of the kernels SGLang 0.5.15.post1 calls on CUDA for a bf16 GLM-4.5 engine
(tp 1, Triton attention, CUDA graphs, NEXTN), for a GPU machine without SGLang's kernel wheel.

Every op is device-agnostic torch. Ops that run inside a captured CUDA graph (norms, activations,
RoPE, MoE align/sum, top-k) use no host sync: fixed output sizes, no `.item()` / `.tolist()`.
`OPS`: names of `sgl_kernel` ops (served by the substitute's module `__getattr__`).
`JIT_OPS`: {module of `sglang.jit_kernel`: {name: op}}, the JIT (nvcc) kernels SGLang calls on CUDA;
scripts/gpu_check installs them over those modules' names when asked to (see its kernel_shim).
Semantics follow SGLang's own native paths (`forward_native`) and kernel sources of the same name.
"""
import torch
import torch.nn.functional as F

from .spec_ops import build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if gemma else weight.float()
    return (xf * w).to(x.dtype)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    res = _rms(input, weight, eps)
    if out is None:
        return res
    out.copy_(res)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None, cast_x_before_out_mul=False):
    """In place: residual += input; input = rmsnorm(residual)."""
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    res = _rms(input, weight, eps, gemma=True)
    if out is None:
        return res
    out.copy_(res)
    return out


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, gemma=True))


def _gated(act, input, out):
    d = input.shape[-1] // 2
    res = act(input[..., :d].float()).to(input.dtype) * input[..., d:]
    if out is None:
        return res
    out.copy_(res)
    return out


def silu_and_mul(input, out=None, expert_ids=None, expert_step=1, enable_pdl=None):
    return _gated(F.silu, input, out)


def gelu_and_mul(input, out=None, expert_ids=None, expert_step=1, enable_pdl=None):
    return _gated(lambda x: F.gelu(x, approximate="none"), input, out)


def gelu_tanh_and_mul(input, out=None, expert_ids=None, expert_step=1, enable_pdl=None):
    return _gated(lambda x: F.gelu(x, approximate="tanh"), input, out)


def relu2(input, out=None):
    res = torch.square(F.relu(input))
    if out is None:
        return res
    out.copy_(res)
    return out


def moe_sum_reduce(input, output, routed_scaling_factor=1.0):
    """output[t] = sum_k input[t, k] * routed_scaling_factor (input [T, topk, H])."""
    output.copy_((input.float().sum(dim=1) * routed_scaling_factor).to(output.dtype))


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids,
                         num_tokens_post_pad, cumsum_buffer, pad_sorted_token_ids=False):
    """SGLang's CUDA kernel (jit_kernel/csrc/moe/moe_align_kernel.cu), capturable: bucket b = id + 1
    (ids -1 of filtered experts go to bucket 0), each bucket padded to a multiple of `block_size`;
    sorted_token_ids lists flat token slots bucket by bucket (padding = numel), expert_ids[block] = b - 1,
    num_tokens_post_pad[0] = padded total, cumsum_buffer[:num_experts + 1] = padded bucket starts."""
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64) + 1
    n = ids.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    starts[1:] = torch.cumsum(padded, 0)
    raw_starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    bucket = ids[order]
    dest = starts[bucket] + torch.arange(n, device=dev) - raw_starts[bucket]
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(n)
    sorted_token_ids[dest] = order.to(sorted_token_ids.dtype)
    block_start = torch.arange(expert_ids.numel(), device=dev) * block_size
    expert_ids.copy_((torch.searchsorted(starts[1:], block_start, right=True) - 1).to(expert_ids.dtype))
    num_tokens_post_pad.copy_(starts[-1:].to(num_tokens_post_pad.dtype))
    cumsum_buffer[: num_experts + 1].copy_(starts.to(cumsum_buffer.dtype))


def _topk_out(topk_weights, topk_ids, scores, renormalize, correction_bias=None):
    k = topk_ids.shape[-1]
    pick = scores if correction_bias is None else scores + correction_bias.float()
    idx = torch.topk(pick, k, dim=-1).indices
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    topk_weights.copy_(w.to(topk_weights.dtype))
    topk_ids.copy_(idx.to(topk_ids.dtype))


def topk_softmax(topk_weights, topk_ids, gating_output, renormalize=False, moe_softcapping=0.0,
                 correction_bias=None):
    logits = gating_output.float()
    if moe_softcapping:
        logits = torch.tanh(logits / moe_softcapping) * moe_softcapping
    _topk_out(topk_weights, topk_ids, torch.softmax(logits, dim=-1), renormalize, correction_bias)


def topk_sigmoid(topk_weights, topk_ids, gating_output, renormalize=False, correction_bias=None):
    _topk_out(topk_weights, topk_ids, torch.sigmoid(gating_output.float()), renormalize, correction_bias)


def fast_topk(values, topk, dim):
    """SGLang's own torch fallback (srt/utils/common.py `fast_topk`) has these semantics."""
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    xf = x.float()
    if is_neox:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def apply_rope_with_cos_sin_cache_inplace(positions=None, query=None, key=None, head_size=None,
                                          cos_sin_cache=None, is_neox=True, *, q=None, k=None,
                                          rope_dim=0, fused_args=None, **_):
    """RoPE in place on q [T, Hq, rot] and k [T, Hk, rot] (views allowed); cos_sin_cache
    [max_pos, rot] holds cos then sin. Both the sgl_kernel (positions, query, key, head_size, ...)
    and the jit_kernel (q, k, cos_sin_cache, positions, is_neox=...) calling conventions."""
    if fused_args is not None:
        raise NotImplementedError("torch RoPE substitute: fused RoPE + KV-cache store is not implemented")
    q = query if q is None else q
    k = key if k is None else k
    rot = rope_dim or cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.reshape(-1).long()).float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2 : rot]
    for t in (q, k):
        if t is not None:
            v = t if t.dim() == 3 else t.view(t.shape[0], -1, head_size)  # sgl_kernel: [T, H * head_size]
            part = v[..., :rot]
            part.copy_(_rope(part, cos, sin, is_neox))


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox)


def clamp_position_cuda(seq_lens: torch.Tensor) -> torch.Tensor:
    return torch.clamp(seq_lens - 1, min=0)


def resolve_future_token_ids_cuda(input_ids: torch.Tensor, future_token_ids_map: torch.Tensor) -> None:
    """In place: every negative id v becomes future_token_ids_map[-v]."""
    neg = input_ids < 0
    looked = future_token_ids_map[torch.where(neg, -input_ids, torch.zeros_like(input_ids)).long()]
    input_ids.copy_(torch.where(neg, looked.to(input_ids.dtype), input_ids))


def build_tree_kernel_efficient(*args, **kwargs):
    return build_tree_kernel_efficient_cpu(*args, **kwargs)


def verify_tree_greedy(*args, **kwargs):
    return verify_tree_greedy_cpu(*args, **kwargs)


def can_use_store_cache(size: int) -> bool:
    """The JIT KV-store kernel is not built: SGLang then stores K/V with torch indexing."""
    return False


def is_supported_hidden_size(_d: int) -> bool:
    return False


OPS = {fn.__name__: fn for fn in (
    rmsnorm, fused_add_rmsnorm, gemma_rmsnorm, gemma_fused_add_rmsnorm, silu_and_mul, gelu_and_mul,
    gelu_tanh_and_mul, moe_sum_reduce, moe_align_block_size, topk_softmax, topk_sigmoid, fast_topk,
    rotary_embedding, build_tree_kernel_efficient, verify_tree_greedy,
)}

JIT_OPS = {
    "sglang.jit_kernel.activation": {f.__name__: f for f in (silu_and_mul, gelu_and_mul, gelu_tanh_and_mul, relu2)},
    "sglang.jit_kernel.norm": {"fused_add_rmsnorm": fused_add_rmsnorm, "rmsnorm": rmsnorm,
                               "is_supported_jit_fused_add_rmsnorm_hidden_size": is_supported_hidden_size},
    "sglang.jit_kernel.rope": {"apply_rope_with_cos_sin_cache_inplace": apply_rope_with_cos_sin_cache_inplace,
                               "rotary_embedding": rotary_embedding},
    "sglang.jit_kernel.clamp_position": {"clamp_position_cuda": clamp_position_cuda},
    "sglang.jit_kernel.resolve_future_token_ids": {"resolve_future_token_ids_cuda": resolve_future_token_ids_cuda},
    "sglang.jit_kernel.kvcache": {"can_use_store_cache": can_use_store_cache},
}

