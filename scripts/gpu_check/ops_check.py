"""The kernel substitute's CUDA-named ops (sgl_kernel_cpu/cuda_ops.py) against SGLang's own native
paths, on `cpu` (the CPU dry run, tests/test_gpu_check.py) or `cuda` (the device check).

    python scripts/gpu_check/ops_check.py cpu|cuda      -> one JSON object {op: {"ok", "detail"}}
References are real SGLang 0.5.15.post1 code: RMSNorm / SiluAndMul / GeluAndMul / RotaryEmbedding
`forward_native`, `fused_topk_torch_native`, `moe_sum_reduce_torch_compile`'s arithmetic, the
forward batch's `_clamp_position_native`; moe_align_block_size is checked against its contract
(the one the Triton fused-MoE kernel reads), since SGLang has no torch version of it.
"""
import json
import os
import sys


def _close(a, b, tol):
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    return bool(err <= tol and a.shape == b.shape), f"max |diff| {err:.2e} (tol {tol:g}), shape {tuple(a.shape)}"


def run(device: str) -> dict:
    import torch

    from sglang_patches.cpu.sgl_kernel_cpu import cuda_ops as ops

    from rollout.models.tiny import build_tiny_glm
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    # the layers read the process's server args, as in an engine: those of the tiny GLM on this device
    set_global_server_args_for_scheduler(ServerArgs(model_path=build_tiny_glm(), device=device))
    torch.manual_seed(0)
    out = {}

    def rec(name, res):
        out[name] = {"ok": res[0], "detail": res[1]}

    from sglang.srt.layers.layernorm import RMSNorm

    H, T, bf = 96, 7, torch.bfloat16
    norm = RMSNorm(H, eps=1e-5).to(device)
    norm.weight.data = (1 + 0.1 * torch.randn(H)).to(device)
    x, res = torch.randn(T, H, device=device, dtype=bf), torch.randn(T, H, device=device, dtype=bf)
    rec("rmsnorm", _close(ops.rmsnorm(x, norm.weight.data.to(bf), 1e-5), norm.to(bf).forward_native(x), 2e-2))
    want_x, want_r = norm.forward_native(x.clone(), res.clone())
    got_x, got_r = x.clone(), res.clone()
    ops.fused_add_rmsnorm(got_x, got_r, norm.weight.data, 1e-5)
    ok1, d1 = _close(got_x, want_x, 2e-2)
    ok2, d2 = _close(got_r, want_r, 1e-2)
    rec("fused_add_rmsnorm", (ok1 and ok2, f"out {d1}; residual {d2}"))

    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul

    g = torch.randn(T, 64, device=device, dtype=bf)
    silu = SiluAndMul().forward_native(g)
    rec("silu_and_mul", _close(ops.silu_and_mul(g), silu, 2e-2))
    buf = torch.empty(T, 32, device=device, dtype=bf)
    ops.silu_and_mul(g, buf)  # the jit_kernel convention: (input, out)
    rec("silu_and_mul(out=)", _close(buf, silu, 2e-2))
    gelu = GeluAndMul().forward_native(g)
    rec("gelu_and_mul", _close(ops.gelu_and_mul(g), gelu, 2e-2))

    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    for neox in (True, False):  # the tiny GLM: head 16, partial rotary 8 (neox)
        rope = RotaryEmbedding(16, 8, 2048, 10000, neox, torch.float32).to(device)
        pos = torch.tensor([0, 3, 17, 1000, 5], device=device)
        q, k = torch.randn(5, 4 * 16, device=device), torch.randn(5, 2 * 16, device=device)
        wq, wk = rope.forward_native(pos, q.clone(), k.clone())
        cache = rope.cos_sin_cache.float()
        jq, jk = q.clone(), k.clone()  # jit_kernel convention: [T, H, rot] views, keyword is_neox
        ops.apply_rope_with_cos_sin_cache_inplace(q=jq.view(5, 4, 16)[..., :8], k=jk.view(5, 2, 16)[..., :8],
                                                  cos_sin_cache=cache, positions=pos, is_neox=neox)
        sq, sk = q.clone(), k.clone()  # what RotaryEmbedding.forward_cuda calls for head 16 (its fallback)
        ops.rotary_embedding(pos, sq, sk, 16, cache, neox)
        oks = [_close(a, b, 1e-5) for a, b in ((jq, wq), (jk, wk), (sq, wq), (sk, wk))]
        rec(f"rope(neox={neox})", (all(o for o, _ in oks), "; ".join(d for _, d in oks[:1] + oks[2:3])))

    from sglang.srt.layers.moe.topk import fused_topk_torch_native

    logits = torch.randn(T, 16, device=device)
    bias = 0.01 * torch.randn(16, device=device)
    for fn, scoring, b in ((ops.topk_softmax, "softmax", None), (ops.topk_sigmoid, "sigmoid", bias)):
        w, i = torch.empty(T, 4, device=device), torch.empty(T, 4, dtype=torch.int32, device=device)
        fn(w, i, logits, True, **({"correction_bias": b} if b is not None else {}))
        ww, wi = fused_topk_torch_native(logits, logits, 4, True, correction_bias=b, scoring_func=scoring)
        same = all(sorted(r) == sorted(s) for r, s in zip(i.tolist(), wi.tolist()))
        ok_w, dw = _close(w.sort(-1).values, ww.float().sort(-1).values, 1e-5)
        rec(fn.__name__, (same and ok_w, f"expert sets equal: {same}; weights {dw}"))

    x3 = torch.randn(T, 4, 32, device=device, dtype=bf)
    o = torch.empty(T, 32, device=device, dtype=bf)
    ops.moe_sum_reduce(x3, o, 2.5)
    rec("moe_sum_reduce", _close(o, (x3.float().sum(1) * 2.5).to(bf), 5e-2))

    rec("moe_align_block_size", _align_contract(ops, device))

    from sglang.srt.model_executor.forward_batch_info import _clamp_position_native

    sl = torch.tensor([0, 1, 5], dtype=torch.int32, device=device)
    got = ops.clamp_position_cuda(sl)
    rec("clamp_position", (got.tolist() == _clamp_position_native(sl).tolist() and got.dtype == sl.dtype,
                           f"{got.tolist()} ({got.dtype})"))
    ids = torch.tensor([5, -1, 7, -2], device=device)
    ops.resolve_future_token_ids_cuda(ids, torch.tensor([0, 42, 43], device=device))
    rec("resolve_future_token_ids", (ids.tolist() == [5, 42, 7, 43], str(ids.tolist())))
    return out


def _align_contract(ops, device):
    """For random top-k ids (some -1, as under EP): every valid token slot sits in a block of its expert,
    each slot exactly once, blocks padded with numel, totals and starts consistent."""
    import torch

    g = torch.Generator().manual_seed(1)
    for T, E, bs in ((1, 16, 16), (7, 16, 16), (33, 8, 4)):
        topk = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)]).to(torch.int32)
        topk[0, 0] = -1
        topk = topk.to(device)
        n = topk.numel()
        cap = n + (E + 1) * (bs - 1) if n >= E + 1 else n * bs
        sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
        expert_ids = torch.empty((cap + bs - 1) // bs, dtype=torch.int32, device=device)
        post, cums = torch.empty(1, dtype=torch.int32, device=device), torch.empty(E + 2, dtype=torch.int32, device=device)
        ops.moe_align_block_size(topk, E + 1, bs, sorted_ids, expert_ids, post, cums, True)
        flat, s, e, total = topk.flatten().tolist(), sorted_ids.tolist(), expert_ids.tolist(), int(post.item())
        padded = [(sum(1 for v in flat if v == x - 1) + bs - 1) // bs * bs for x in range(E + 1)]
        want_total = sum(padded)
        seen = [t for t in s[:total] if t < n]
        bad = [(b, t) for b in range(total // bs) for t in s[b * bs:(b + 1) * bs] if t < n and flat[t] != e[b]]
        if total != want_total or sorted(seen) != list(range(n)) or bad or any(t != n for t in s[total:]):
            return False, f"T={T} E={E} bs={bs}: total {total} (want {want_total}), misplaced {bad[:3]}"
        if cums.tolist()[:E + 1] != [sum(padded[:i]) for i in range(E + 1)]:
            return False, f"T={T} E={E} bs={bs}: cumsum {cums.tolist()}"
    return True, "3 shapes: every slot once, in a block of its expert (-1 in blocks of -1), padding = numel"


if __name__ == "__main__":
    sys.path[:0] = [os.getcwd()]
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if dev == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU platform (its native layer paths)
    print(json.dumps(run(dev)))
