"""Paged extend/decode attention, as `torch.ops.sgl_kernel.{extend,decode}_attention_cpu`.

Called by SGLang's intel_amx attention backend
(srt/layers/attention/intel_amx_backend.py). K/V of earlier tokens live in a
token pool (k_buffer/v_buffer rows) addressed through req_to_token. Plain
float32 softmax attention with GQA (q head h reads kv head h // (H/Hkv)),
optional logit cap, attention sinks and sliding window (a key j is visible to
a query at position p when p - j < sliding_window, if sliding_window > 0).
"""
import torch

_LIB = []  # keeps the torch.library registration alive

EXTEND_SCHEMA = (
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)
DECODE_SCHEMA = (
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, "
    "float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, "
    "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
    "bool is_cross_attention, int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()"
)


def _unsupported(op, what):
    raise NotImplementedError(f"sgl_kernel CPU substitute: op '{op}' does not implement {what}")


def _read_pool(buf, idx, scale):
    rows = buf[idx].float()
    return rows * scale if scale != 1.0 else rows


def _attend(q, k, v, visible, sm_scale, logit_cap, sinks):
    """q [M,H,D], k [N,Hkv,D], v [N,Hkv,Dv], visible [M,N] bool -> [M,H,Dv] float32."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs)  # rows with nothing visible give zeros
    return torch.einsum("hmn,nhd->mhd", probs, v)


def _window(visible, q_pos, k_pos, sliding_window):
    if sliding_window > 0:
        visible &= (q_pos.view(-1, 1) - k_pos.view(1, -1)) < sliding_window
    return visible


def _tree_rows(tree_mask, ext_lens, seq_lens):
    """Per-request custom mask rows: QLEN_ONLY blocks [E,E] or FULL_MASK blocks [E,L]."""
    qlen_only = sum(e * e for e in ext_lens)
    full = sum(e * s for e, s in zip(ext_lens, seq_lens))
    flat = tree_mask.reshape(-1)
    if flat.dtype != torch.bool:
        if flat.dtype == torch.uint8 and flat.numel() not in (qlen_only, full):
            _unsupported("extend_attention_cpu", "bit-packed tree masks")
        flat = flat != 0
    if flat.numel() == qlen_only:
        cols = list(ext_lens)
    elif flat.numel() == full:
        cols = list(seq_lens)
    else:
        raise ValueError(
            f"extend_attention_cpu: tree_mask has {flat.numel()} entries, expected {qlen_only} or {full}"
        )
    out, off = [], 0
    for e, c in zip(ext_lens, cols):
        out.append(flat[off : off + e * c].view(e, c))
        off += e * c
    return out


def extend_attention_cpu(
    q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale,
    req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
    max_len_extend, sm_scale, logit_cap, is_cross_attention, sliding_window,
    encoder_lens, sinks, tree_mask, is_causal,
):
    """Prefill/extend: each request's extend queries attend to its prefix
    (from the pool) and its extend tokens (causal, or the tree mask)."""
    if is_cross_attention:
        _unsupported("extend_attention_cpu", "cross attention")
    lens = seq_lens.tolist()
    ext = extend_seq_lens.tolist()
    starts = extend_start_loc.tolist()
    rows = req_pool_indices.tolist()
    masks = _tree_rows(tree_mask, ext, lens) if tree_mask is not None else None
    for b, (L, E, s, r) in enumerate(zip(lens, ext, starts, rows)):
        if E == 0:
            continue
        P = L - E
        if k_extend is not None:
            idx = req_to_token[r, :P].long()
            k = torch.cat([_read_pool(k_buffer, idx, k_scale), k_extend[s : s + E].float()])
            v = torch.cat([_read_pool(v_buffer, idx, v_scale), v_extend[s : s + E].float()])
        else:
            idx = req_to_token[r, :L].long()
            k, v = _read_pool(k_buffer, idx, k_scale), _read_pool(v_buffer, idx, v_scale)
        visible = torch.ones((E, L), dtype=torch.bool)
        if masks is not None:
            m = masks[b]
            visible[:, L - m.shape[1] :] = m
        elif is_causal:
            visible[:, P:] = torch.ones((E, E), dtype=torch.bool).tril()
        q_pos = torch.arange(P, L)
        visible = _window(visible, q_pos, torch.arange(L), sliding_window)
        out = _attend(q_extend[s : s + E], k, v, visible, sm_scale, logit_cap, sinks)
        o_extend[s : s + E] = out.to(o_extend.dtype)


def decode_attention_cpu(
    query, k_buffer, v_buffer, k_scale, v_scale, output, key, value, loc, attn_logits,
    req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attention,
    sliding_window, encoder_lens, sinks,
):
    """Decode: write the new token's K/V at loc (when given), then each query
    attends to req_to_token[rpi, :seq_len]. attn_logits is scratch (unused)."""
    if is_cross_attention:
        _unsupported("decode_attention_cpu", "cross attention")
    loc = loc.long()
    if key is not None:
        k_buffer[loc] = key.to(k_buffer.dtype).view(-1, *k_buffer.shape[1:])
    if value is not None:
        v_buffer[loc] = value.to(v_buffer.dtype).view(-1, *v_buffer.shape[1:])
    lens = seq_lens.tolist()
    for b, (L, r) in enumerate(zip(lens, req_pool_indices.tolist())):
        if L == 0:
            continue
        idx = req_to_token[r, :L].long()
        k, v = _read_pool(k_buffer, idx, k_scale), _read_pool(v_buffer, idx, v_scale)
        visible = _window(torch.ones((1, L), dtype=torch.bool), torch.tensor([L - 1]), torch.arange(L), sliding_window)
        out = _attend(query[b : b + 1], k, v, visible, sm_scale, logit_cap, sinks)
        output[b] = out[0].to(output.dtype)


# SGLang before 0.5.20 (sglang-kernel 0.4) calls both ops without k_scale / v_scale.
SCALES = "float k_scale, float v_scale, "
SCALES_SINCE = (0, 5, 20)
SCALES_AT = {"extend_attention_cpu": 6, "decode_attention_cpu": 3}  # positional index of k_scale


def takes_scales(sglang_version=None) -> bool:
    """Whether the installed SGLang passes k_scale / v_scale to the attention ops."""
    import re
    from importlib.metadata import PackageNotFoundError, version

    if sglang_version is None:
        try:
            sglang_version = version("sglang")
        except PackageNotFoundError:
            return True
    return tuple(int(x) for x in re.findall(r"\d+", sglang_version)[:3]) >= SCALES_SINCE


def unscaled(name, fn):
    """`fn` as the pre-0.5.20 op: the same arguments without the two scales (1.0 each)."""
    at = SCALES_AT[name]

    def op(*args):
        return fn(*args[:at], 1.0, 1.0, *args[at:])

    op.__name__ = name
    return op


def register_torch_ops(impls=None) -> None:
    """Make torch.ops.sgl_kernel.{extend,decode}_attention_cpu call the functions above
    (or impls[name]), with the argument list the installed SGLang calls. Idempotent; skips an op
    already registered (e.g. by a real sgl_kernel)."""
    impls = impls or {}
    ns = torch.ops.sgl_kernel
    scaled = takes_scales()
    todo = [
        (name, schema if scaled else schema.replace(SCALES, ""),
         impls.get(name, fn) if scaled else unscaled(name, impls.get(name, fn)))
        for name, schema, fn in (
            ("extend_attention_cpu", EXTEND_SCHEMA, extend_attention_cpu),
            ("decode_attention_cpu", DECODE_SCHEMA, decode_attention_cpu),
        )
        if not hasattr(ns, name)
    ]
    if not todo:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema, fn in todo:
        lib.define(schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _LIB.append(lib)
