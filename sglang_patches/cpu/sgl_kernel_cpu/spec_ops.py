"""Speculative-decoding ops: EAGLE tree build, greedy tree verify, bonus tokens,
accept compaction. Semantics follow SGLang 0.5.23's Triton kernels
(kernels/ops/speculative/spec_tree.py, eagle.py); written here as plain Python
loops over the (small) batch. All outputs are written in place.
"""
import torch

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def _find(values, target):
    """Index of the first occurrence of target in values, or -1."""
    for i, v in enumerate(values):
        if v == target:
            return i
    return -1


def _parent_slot(sel, parents, i, topk):
    """Tree slot of draft token i's parent (0 = the verified root), or -1 if unknown.
    Draft token i (>= 1) is sel[i-1]; its parent's top-k block is sel[i-1] // topk."""
    block = sel[i - 1] // topk
    if block == 0:
        return 0
    pos = _find(sel, parents[block])
    return pos + 1 if pos >= 0 else -1


def build_tree_kernel_efficient_cpu(
    parent_list, selected_index, verified_seq_len, tree_mask, positions,
    retrieve_index, retrieve_next_token, retrieve_next_sibling,
    topk, depth, draft_token_num, tree_mask_mode,
):
    """Builds the draft tree of each request: retrieve_index / next_token /
    next_sibling links (children linked newest-first, as in SGLang), the tree
    attention mask and the draft positions (seq_len + depth in the tree)."""
    mode = int(tree_mask_mode)
    if mode == QLEN_ONLY_BITPACKING:
        raise NotImplementedError("build_tree_kernel_efficient_cpu: tree_mask_mode QLEN_ONLY_BITPACKING is not implemented")
    d = draft_token_num
    bs = verified_seq_len.numel()
    seq_lens = verified_seq_len.tolist()
    parents_all = parent_list.reshape(bs, -1).tolist()
    sel_all = selected_index.reshape(bs, -1).tolist()
    next_tok = retrieve_next_token.view(bs, d)
    next_sib = retrieve_next_sibling.view(bs, d)
    ridx = retrieve_index.view(bs, d)
    pos_out = positions.view(bs, d)
    mask_base = 0
    for b in range(bs):
        parents, sel, seq_len = parents_all[b], sel_all[b], seq_lens[b]
        nt = next_tok[b].tolist()
        ns = next_sib[b].tolist()
        for i in range(d - 1, 0, -1):
            p = _parent_slot(sel, parents, i, topk)
            if p < 0:
                continue
            if nt[p] != -1:
                ns[i] = nt[p]
            nt[p] = i
        next_tok[b] = torch.tensor(nt, dtype=next_tok.dtype)
        next_sib[b] = torch.tensor(ns, dtype=next_sib.dtype)
        ridx[b] = torch.arange(b * d, (b + 1) * d, dtype=ridx.dtype)

        # Tree mask rows: FULL_MASK rows span prefix + draft (prefix columns are
        # left as the caller set them); QLEN_ONLY rows span the draft tokens only.
        row_len = seq_len + d if mode == FULL_MASK else d
        col0 = seq_len if mode == FULL_MASK else 0
        rows = tree_mask[mask_base : mask_base + d * row_len].view(d, row_len)
        mask_base += d * row_len
        rows[:, col0:] = False
        rows[:, col0] = True
        depths = [0] * d
        for x in range(1, d):
            cur, level = x - 1, 0
            for _ in range(depth):
                level += 1
                rows[x, col0 + 1 + cur] = True
                block = sel[cur] // topk
                if block == 0:
                    break
                cur = _find(sel, parents[block])
                if cur < 0:
                    break
            depths[x] = level
        pos_out[b] = torch.tensor([seq_len + lv for lv in depths], dtype=pos_out.dtype)


def verify_tree_greedy_cpu(
    predicts, accept_index, accept_token_num, candidates,
    retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
):
    """Greedy walk down each request's draft tree: at every level accept the
    first child (following sibling links) whose token equals the target's
    argmax at the last accepted node. Writes predicts (target token at each
    accepted node, plus the bonus token at the last one), accept_index (flat
    node ids, slot 0 = root) and accept_token_num (accepted drafts, root excluded)."""
    bs, d = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    ridx = retrive_index.tolist()
    nxt = retrive_next_token.tolist()
    sib = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        last = ridx[b][0]
        accepted = [last]
        cur = 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = want
            last = ridx[b][cur]
            accepted.append(last)
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = len(accepted) - 1
        predicts[last] = target[last]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus[i] = accept_tokens.flat[accept_stride*i + accept_lens[i] - 1]."""
    flat = accept_tokens.reshape(-1)
    n = bonus_tokens.numel()
    idx = torch.arange(n, dtype=torch.int64) * accept_stride + accept_lens[:n].to(torch.int64) - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compaction: dst[:n] = out_cache_loc[accept_index[accept_index != -1]] (flat order)."""
    flat = accept_index.reshape(-1).to(torch.int64)
    keep = flat[flat != -1]
    accept_out_cache_loc[: keep.numel()] = out_cache_loc[keep].to(accept_out_cache_loc.dtype)
