"""The CPU `sgl_kernel` substitute: each op against a plain reference.

Attention is checked against torch's scaled_dot_product_attention; cache ops
against straightforward indexing; tree build / greedy verify / bonus tokens /
accept compaction / cache-loc kernels against SGLang's own Triton kernels run
by Triton's CPU interpreter (TRITON_INTERPRET=1) in one subprocess.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import sgl_kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    not getattr(sgl_kernel, "IS_CPU_SUBSTITUTE", False), reason="a real sgl_kernel is installed"
)


# ---------------------------------------------------------------- packaging


def test_substitute_is_served_and_registers_attention_ops():
    ns = torch.ops.sgl_kernel
    assert hasattr(ns, "extend_attention_cpu") and hasattr(ns, "decode_attention_cpu")
    # SGLang's AMX linear/MoE probe must stay off: only the attention ops exist.
    assert not hasattr(ns, "convert_weight_packed")
    for name in sgl_kernel._ops.OPS:
        assert getattr(sgl_kernel, name) is sgl_kernel._ops.OPS[name]


def test_unimplemented_op_raises_naming_it():
    from sgl_kernel import fused_experts_cpu  # import-time names resolve
    from sgl_kernel.mamba import causal_conv1d_fn_cpu

    with pytest.raises(NotImplementedError, match="'fused_experts_cpu'"):
        fused_experts_cpu(torch.zeros(1))
    with pytest.raises(NotImplementedError, match="causal_conv1d_fn_cpu"):
        causal_conv1d_fn_cpu()


def test_real_sgl_kernel_on_path_wins(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL_BUILD = True\n")
    code = (
        "import sgl_kernel, torch; print(sgl_kernel.REAL_BUILD, hasattr(sgl_kernel, 'IS_CPU_SUBSTITUTE'),"
        " hasattr(torch.ops.sgl_kernel, 'extend_attention_cpu'))"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


# ---------------------------------------------------------------- attention


def _paged_setup(seed, prefix_lens, ext_lens, hq=4, hkv=2, d=16, pool=64, dtype=torch.float32):
    """Random pool with shuffled slots; req_to_token rows for requests on rows 2, 0, 3..."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(pool, hkv, d, generator=g).to(dtype)
    r2t = torch.zeros(5, 40, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 3, 1, 4][: len(prefix_lens)])
    slots = torch.randperm(pool, generator=g)
    used = 0
    for row, p, e in zip(rpi.tolist(), prefix_lens, ext_lens):
        r2t[row, : p + e] = slots[used : used + p + e].to(torch.int32)
        used += p + e
    total = sum(ext_lens)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k_ext = torch.randn(total, hkv, d, generator=g).to(dtype)
    v_ext = torch.randn(total, hkv, d, generator=g).to(dtype)
    return q, k_ext, v_ext, k_buf, v_buf, r2t, rpi


def _sdpa(q, k, v, mask, scale):
    """q [M,H,D], k/v [N,Hkv,D], mask [M,N] bool -> [M,H,D] via torch SDPA (GQA)."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def _run_extend(q, k_ext, v_ext, k_buf, v_buf, r2t, rpi, prefix_lens, ext_lens, *, tree_mask=None, causal=True, window=0, scale=0.25):
    seq_lens = torch.tensor([p + e for p, e in zip(prefix_lens, ext_lens)], dtype=torch.int64)
    ext = torch.tensor(ext_lens, dtype=torch.int32)
    starts = (torch.cumsum(ext, 0) - ext).to(torch.int32)
    o = torch.empty_like(q)
    torch.ops.sgl_kernel.extend_attention_cpu(
        q, k_ext, v_ext, o, k_buf, v_buf, 1.0, 1.0, r2t, rpi, seq_lens, ext, starts,
        max(ext_lens), scale, 0.0, False, window, None, None, tree_mask, causal,
    )
    return o


def _full_kv(k_ext, v_ext, k_buf, v_buf, r2t, row, p, s, e):
    idx = r2t[row, :p].long()
    return torch.cat([k_buf[idx], k_ext[s : s + e]]), torch.cat([v_buf[idx], v_ext[s : s + e]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_matches_sdpa_gqa_causal_with_paged_prefix(dtype):
    prefix, ext = [0, 7, 3], [5, 4, 1]
    q, k_ext, v_ext, k_buf, v_buf, r2t, rpi = _paged_setup(1, prefix, ext, dtype=dtype)
    o = _run_extend(q, k_ext, v_ext, k_buf, v_buf, r2t, rpi, prefix, ext)
    s = 0
    for row, p, e in zip(rpi.tolist(), prefix, ext):
        k, v = _full_kv(k_ext, v_ext, k_buf, v_buf, r2t, row, p, s, e)
        mask = torch.ones(e, p + e, dtype=torch.bool)
        mask[:, p:] = torch.ones(e, e, dtype=torch.bool).tril()
        ref = _sdpa(q[s : s + e], k, v, mask, 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(o[s : s + e].float(), ref, atol=tol, rtol=tol)
        s += e


def test_extend_attention_non_causal_and_sliding_window_match_sdpa():
    prefix, ext = [6, 2], [3, 4]
    q, k_ext, v_ext, k_buf, v_buf, r2t, rpi = _paged_setup(2, prefix, ext)
    o_full = _run_extend(q, k_ext, v_ext, k_buf, v_buf, r2t, rpi, prefix, ext, causal=False)
    o_win = _run_extend(q, k_ext, v_ext, k_buf, v_buf, r2t, rpi, prefix, ext, window=3)  # sliding_window_size 2
    s = 0
    for row, p, e in zip(rpi.tolist(), prefix, ext):
        k, v = _full_kv(k_ext, v_ext, k_buf, v_buf, r2t, row, p, s, e)
        full = torch.ones(e, p + e, dtype=torch.bool)
        torch.testing.assert_close(o_full[s : s + e], _sdpa(q[s : s + e], k, v, full, 0.25))
        qp, kp = torch.arange(p, p + e).view(-1, 1), torch.arange(p + e).view(1, -1)
        win = (kp <= qp) & (qp - kp <= 2)
        torch.testing.assert_close(o_win[s : s + e], _sdpa(q[s : s + e], k, v, win, 0.25))
        s += e


def test_extend_attention_tree_mask_qlen_only_matches_sdpa():
    # topk 2, 2 steps, 4 draft tokens: root 0; children 1, 2 of root; 3 child of 1.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    prefix, ext = [5, 3], [4, 4]
    q, k_ext, v_ext, k_buf, v_buf, r2t, rpi = _paged_setup(3, prefix, ext)
    o = _run_extend(q, k_ext, v_ext, k_buf, v_buf, r2t, rpi, prefix, ext, tree_mask=torch.cat([tree.flatten()] * 2))
    s = 0
    for row, p, e in zip(rpi.tolist(), prefix, ext):
        k, v = _full_kv(k_ext, v_ext, k_buf, v_buf, r2t, row, p, s, e)
        mask = torch.cat([torch.ones(e, p, dtype=torch.bool), tree], dim=1)
        torch.testing.assert_close(o[s : s + e], _sdpa(q[s : s + e], k, v, mask, 0.25))
        s += e


def test_decode_attention_writes_kv_then_matches_sdpa():
    lens = [6, 1, 9]
    _, _, _, k_buf, v_buf, r2t, rpi = _paged_setup(4, [n - 1 for n in lens], [1, 1, 1])
    g = torch.Generator().manual_seed(5)
    q, k_new, v_new = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    loc = torch.stack([r2t[row, n - 1] for row, n in zip(rpi.tolist(), lens)]).long()
    o = torch.empty_like(q)
    logits = torch.zeros(3, 4, 8, 17)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    torch.ops.sgl_kernel.decode_attention_cpu(
        q, k_buf, v_buf, 1.0, 1.0, o, k_new, v_new, loc, logits, r2t, rpi, seq_lens, 0.25, 0.0, False, 0, None, None
    )
    torch.testing.assert_close(k_buf[loc], k_new)
    torch.testing.assert_close(v_buf[loc], v_new)
    for b, (row, n) in enumerate(zip(rpi.tolist(), lens)):
        idx = r2t[row, :n].long()
        ref = _sdpa(q[b : b + 1], k_buf[idx], v_buf[idx], torch.ones(1, n, dtype=torch.bool), 0.25)
        torch.testing.assert_close(o[b : b + 1], ref)


def test_logit_cap_and_sinks_match_hand_formula():
    q, k_ext, v_ext, k_buf, v_buf, r2t, rpi = _paged_setup(6, [4], [1], hq=2, hkv=1, d=8)
    sinks = torch.tensor([0.5, -1.0])
    o = torch.empty_like(q)
    torch.ops.sgl_kernel.extend_attention_cpu(
        q, k_ext, v_ext, o, k_buf, v_buf, 1.0, 1.0, r2t, rpi, torch.tensor([5]), torch.tensor([1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), 1, 1.0, 2.0, False, 0, None, sinks, None, True,
    )
    k, v = _full_kv(k_ext, v_ext, k_buf, v_buf, r2t, rpi[0].item(), 4, 0, 1)
    for h in range(2):
        s = 2.0 * torch.tanh((k[:, 0] @ q[0, h]) / 2.0)
        w = torch.exp(s) / (torch.exp(s).sum() + torch.exp(sinks[h]))
        torch.testing.assert_close(o[0, h], w @ v[:, 0])


# ---------------------------------------------------------------- cache ops


def test_copy_all_layer_kv_cache_moves_rows_in_place():
    g = torch.Generator().manual_seed(7)
    bufs = [torch.randn(12, 2, 16, generator=g).to(torch.bfloat16) for _ in range(4)] + [torch.randn(12, 3, generator=g)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    tgt = torch.tensor([3, 5, 11, 4])  # 3 <-> 5 swap: only safe if all sources are read first
    src = torch.tensor([5, 3, 0, 4])
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, ref in zip(bufs, before):
        exp = ref.clone()
        exp[tgt] = ref[src]
        assert torch.equal(b, exp)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt[:0], src[:0])  # no-op


def test_req_to_token_assign_and_extend_cache_locs_roundtrip():
    r2t = torch.zeros(4, 20, dtype=torch.int32)
    rpi = torch.tensor([2, 0, 3])
    start, end = torch.tensor([3, 0, 5], dtype=torch.int32), torch.tensor([6, 4, 5], dtype=torch.int32)
    locs = torch.arange(100, 107)
    sgl_kernel.assign_req_to_token_pool_cpu(rpi, r2t, start, end, locs, 20)
    exp = torch.zeros(4, 20, dtype=torch.int32)
    exp[2, 3:6], exp[0, 0:4] = torch.tensor([100, 101, 102]), torch.tensor([103, 104, 105, 106])
    assert torch.equal(r2t, exp)
    out = torch.full((7,), -1, dtype=torch.int64)
    sgl_kernel.assign_extend_cache_locs_cpu(rpi, r2t, start.long(), end.long(), out, 20)
    assert out.tolist() == locs.tolist()


def test_draft_cache_locs_and_draft_decode_metadata():
    r2t = torch.arange(3 * 30, dtype=torch.int32).view(3, 30)
    rpi, seq = torch.tensor([2, 0]), torch.tensor([4, 7])
    out = torch.empty(2 * 2 * 3, dtype=torch.int64)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, seq, out, 30, 2, 3)
    assert out.tolist() == list(range(64, 70)) + list(range(7, 13))
    meta = sgl_kernel.build_draft_decode_metadata_cpu(r2t, rpi, seq, 2, 3, 30)
    assert meta.shape == (4, 30) and meta.dtype == torch.int32
    # candidate (b, k): prefix, then slots seq_len + k*steps + s
    assert meta[1, :7].tolist() == list(range(60, 64)) + [67, 68, 69]
    assert meta[2, :10].tolist() == list(range(0, 7)) + [7, 8, 9]
    assert meta[3, :10].tolist() == list(range(0, 7)) + [10, 11, 12]
    assert int(meta[3, 10:].abs().sum()) == 0


# ------------------------------------------- SGLang's Triton kernels (interpreter)

_TRITON_REFERENCE = textwrap.dedent(
    r"""
    import importlib.util, random, sys, types
    import torch
    import sgl_kernel as K

    # Load only the kernel modules: skip sglang/__init__.py (it imports the whole server).
    spec = importlib.util.find_spec("sglang")
    sys.modules["sglang"] = pkg = types.ModuleType("sglang")
    pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
    from sglang.kernels.ops.kvcache import cache_move
    from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree
    from sglang.srt.utils import next_power_of_2

    rng = random.Random(0)
    torch.manual_seed(0)
    checks = 0

    def same(a, b, what):
        global checks
        assert torch.equal(a, b), f"{what}:\nours {a}\nsglang {b}"
        checks += 1

    def draft_tree(bs, topk, steps, draft):
        # EAGLE-style draft: beam of topk per step, children scored by product.
        scores = torch.rand(bs, topk).sort(dim=1, descending=True).values
        score_list, parents = [scores.unsqueeze(1)], [torch.arange(-1, topk).expand(bs, -1)]
        for i in range(1, steps):
            expand = scores.unsqueeze(2) * torch.rand(bs, topk, topk)
            scores, idx = expand.flatten(1).topk(topk, dim=1)
            score_list.append(expand)
            parents.append(idx + topk * topk * (i - 1) + topk)
        flat = torch.cat(score_list, dim=1).flatten(1)
        sel = flat.topk(draft - 1, dim=1).indices.sort(dim=1).values
        parent_list = torch.cat(parents[:-1], dim=1) if steps > 1 else torch.empty(bs, 0, dtype=torch.long)
        return parent_list.contiguous(), sel

    def build_both(parent_list, sel, seq, topk, steps, draft, mode):
        bs = seq.numel()
        n_mask = bs * draft * draft if mode == 1 else int((seq + draft).sum()) * draft
        outs = []
        for fn in (K.build_tree_kernel_efficient_cpu, spec_tree.sgl_build_tree_kernel_triton):
            t = [torch.ones(n_mask, dtype=torch.bool), torch.zeros(bs * draft, dtype=torch.long)]
            t += [torch.full((bs, draft), -1, dtype=torch.long) for _ in range(3)]
            fn(parent_list, sel, seq, *t, topk, steps, draft, spec_tree.TreeMaskMode(mode))
            outs.append(t)
        for name, a, b in zip(["tree_mask", "positions", "retrieve_index", "next_token", "next_sibling"], *outs):
            same(a, b, f"build_tree {name} topk={topk} steps={steps} draft={draft} mode={mode}")
        return outs[0]

    # Tree build + greedy verify, realistic EAGLE trees and random (fuzzed) inputs.
    for topk, steps, draft in [(1, 2, 3), (1, 3, 4), (2, 2, 4), (2, 3, 6), (4, 3, 8), (3, 4, 10), (2, 1, 2)]:
        for trial in range(3):
            bs = rng.randint(1, 3)
            seq = torch.randint(1, 20, (bs,))
            if trial < 2:
                parent_list, sel = draft_tree(bs, topk, steps, draft)
            else:
                width = topk * (steps - 1) + 1
                parent_list = torch.randint(-1, topk + (steps - 1) * topk * topk, (bs, width))
                sel = torch.randint(0, topk + (steps - 1) * topk * topk, (bs, draft - 1))
            for mode in (0, 1):
                tree = build_both(parent_list, sel, seq, topk, steps, draft, mode)
            _, _, ridx, nxt, sib = tree
            for vocab in (2, 4):
                cand = torch.randint(0, vocab, (bs, draft))
                target = torch.randint(0, vocab, (bs, draft))
                outs = []
                for fn, kw in ((K.verify_tree_greedy_cpu, "retrive_"), (spec_tree.verify_tree_greedy_triton, "retrieve_")):
                    res = dict(predicts=torch.zeros(bs * draft, dtype=torch.int32),
                               accept_index=torch.full((bs, steps + 1), -1, dtype=torch.int32),
                               accept_token_num=torch.zeros(bs, dtype=torch.int32))
                    fn(**res, candidates=cand, target_predict=target,
                       **{kw + "index": ridx, kw + "next_token": nxt, kw + "next_sibling": sib})
                    outs.append(res)
                for key in outs[0]:
                    same(outs[0][key], outs[1][key], f"verify {key} topk={topk} vocab={vocab}")

    # SGLang's own CPU wrapper routes to the substitute (checks its call signature).
    res = spec_tree.verify_tree_greedy_func(torch.zeros(3, dtype=torch.int32), torch.full((1, 3), -1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]),
        torch.tensor([[1, 2, -1]]), torch.full((1, 3), -1), torch.tensor([[6, 7, 9]]))
    same(res[1], torch.tensor([[0, 1, 2]], dtype=torch.int32), "verify_tree_greedy_func chain")
    same(res[0], torch.tensor([6, 7, 9], dtype=torch.int32), "verify_tree_greedy_func predicts")

    # Bonus tokens and accept compaction.
    for bs, width in [(1, 3), (4, 4), (3, 2)]:
        acc = torch.randint(0, 99, (bs, width), dtype=torch.int32)
        lens = torch.randint(1, width + 1, (bs,), dtype=torch.int32)
        a, b = torch.zeros(bs, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32)
        K.fill_bonus_tokens_cpu(acc, lens, a, width)
        eagle.fill_bonus_tokens[(bs,)](acc, lens, b, width)
        same(a, b, "fill_bonus_tokens")
        idx = torch.arange(bs * width, dtype=torch.int32).view(bs, width)
        idx[torch.rand(bs, width) < 0.4] = -1
        loc = torch.randint(0, 500, (bs * width,))
        a, b = torch.full((bs * width,), -5), torch.full((bs * width,), -5)
        K.fill_accept_out_cache_loc_cpu(idx, loc, a)
        eagle.fill_accept_out_cache_loc[(idx.numel(),)](idx, loc, b, next_power_of_2(idx.numel()))
        same(a, b, "fill_accept_out_cache_loc")

    # Cache locations (assign_req_to_token_pool is its inverse; tested in-process).
    pool_len = 48
    for bs in (1, 3):
        rpi = torch.randperm(5)[:bs]
        start = torch.randint(0, 20, (bs,), dtype=torch.int32)
        end = start + torch.randint(0, 9, (bs,), dtype=torch.int32)
        n = int((end - start).sum())
        table = torch.randint(0, 999, (5, pool_len), dtype=torch.int32)
        a, b = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        K.assign_extend_cache_locs_cpu(rpi, table, start.long(), end.long(), a, pool_len)
        cache_locs.assign_extend_cache_locs[(bs,)](rpi, table, start.long(), end.long(), b, pool_len, next_power_of_2(bs))
        same(a, b, "assign_extend_cache_locs")
        for topk, steps in ((1, 2), (2, 3)):
            seq = torch.randint(1, 30, (bs,))
            a, b = torch.zeros(bs * topk * steps, dtype=torch.int64), torch.zeros(bs * topk * steps, dtype=torch.int64)
            K.assign_draft_cache_locs_contiguous_cpu(rpi, table, seq, a, pool_len, topk, steps)
            cache_locs.assign_draft_cache_locs_contiguous[(bs,)](rpi, table, seq, b, pool_len, topk, steps)
            same(a, b, "assign_draft_cache_locs_contiguous")
            # Draft decode rows vs the kv_indices SGLang's GPU backends build for the same steps.
            meta = K.build_draft_decode_metadata_cpu(table, rpi, seq, topk, steps, pool_len)
            total = int(seq.sum()) * topk + bs * topk * steps * steps
            kv = torch.full((steps, total), -1, dtype=torch.int32)
            indptr = torch.zeros((steps, bs * topk + 1), dtype=torch.int32)
            cache_locs.generate_draft_decode_kv_indices[(steps, bs, topk)](
                rpi, table, seq, kv, indptr, torch.zeros(bs * topk, dtype=torch.int64), pool_len,
                total, bs * topk + 1, next_power_of_2(bs), next_power_of_2(steps), next_power_of_2(total), 1)
            for it in range(steps):
                rows = [meta[r, : int(seq[r // topk]) + it + 1] for r in range(bs * topk)]
                flat = torch.cat(rows)
                same(flat, kv[it, : flat.numel()], f"draft decode metadata step {it} topk={topk}")

    # Raw-pointer KV row moves.
    bufs = [torch.randn(16, 2, 8).to(torch.bfloat16) for _ in range(3)]
    copies = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    ptrs2 = torch.tensor([b.data_ptr() for b in copies], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    tgt, src = torch.tensor([1, 2, 9, 0]), torch.tensor([2, 1, 0, 15])
    K.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    cache_move.copy_all_layer_kv_cache_tiled[(3, 1)](ptrs2, strides, tgt, src, 4, 4, BYTES_PER_TILE=64)
    for a, b in zip(bufs, copies):
        same(a, b, "copy_all_layer_kv_cache")
    print("CHECKS", checks)
    """
)


def test_ops_match_sglang_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="none")
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_REFERENCE], env=env, cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    checks = int(out.stdout.split("CHECKS")[-1])
    assert checks > 250, out.stdout


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.e2e
def test_nextn_topk2_through_substitute_equals_transformers(tmp_path):
    """Real SGLang, NEXTN top-k 2 (tree mask, accept compaction, KV moves) on intel_amx
    attention served by the substitute: greedy tokens equal transformers' generate."""
    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.engines import log_text, preset, start_engine, stop_engine

    from rollout.net import auth_headers
    from rollout.models.tiny import build_tiny_glm
    from training_configs.schema import SpeculativeConfig

    model = build_tiny_glm(variant="always-match")
    nextn = SpeculativeConfig(algorithm="NEXTN", num_steps=2, eagle_topk=2, num_draft_tokens=4)
    # routed-expert capture off: the plugin refuses it with EAGLE top-k > 1 (sglang#37949), and this test is the kernels'
    eng = start_engine(preset("b", model, speculative=nextn, routed_experts=False, env={"SGL_KERNEL_CPU_TRACE": "1"}),
                       str(tmp_path))
    try:
        r = requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), timeout=300, json={
            "text": "the quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
        r.raise_for_status()
        got = r.json()
    finally:
        assert stop_engine(eng)[1] == []
    log = log_text(eng)
    for op in ("extend_attention_cpu", "decode_attention_cpu", "build_tree_kernel_efficient_cpu",
               "verify_tree_greedy_cpu", "fill_accept_out_cache_loc_cpu", "build_draft_decode_metadata_cpu"):
        assert f"first call of {op}" in log, op
    assert got["meta_info"]["spec_accept_length"] > 2.0
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = tok("the quick brown fox", return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert got["output_ids"] == ref


def test_attention_ops_take_the_installed_releases_arguments():
    """SGLang before 0.5.20 calls the attention ops without k_scale / v_scale (sglang-kernel 0.4): the
    substitute registers that argument list there and fills both scales with 1.0."""
    from sglang_patches.cpu.sgl_kernel_cpu import attention

    assert not attention.takes_scales("0.5.15.post1") and not attention.takes_scales("0.5.19")
    assert attention.takes_scales("0.5.20") and attention.takes_scales("0.5.23")
    seen = []
    op = attention.unscaled("decode_attention_cpu", lambda *a: seen.append(a))
    op("q", "k", "v", "out", "key")
    assert seen == [("q", "k", "v", 1.0, 1.0, "out", "key")]
    assert attention.SCALES in attention.EXTEND_SCHEMA and attention.SCALES in attention.DECODE_SCHEMA
