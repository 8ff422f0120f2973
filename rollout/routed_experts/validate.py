"""Decode + validate + compact one SGLang routed-experts payload. Cheap enough to be always on.

Checks, each failing with ``RoutedExpertsError`` and a one-line reason:
type and base64; row count ``== len(tokens) - 1 - start_len`` (one more is the stop-edge row, dropped:
see ``_check_size``); whole rows of
``num_hidden_layers * topk`` int32 (an extra layer per token is named as such); dense layers
all zero (a non-zero one is the draft-layer leakage of vllm#48622 / slime#1909); every id in
``[0, num_experts)``; no id twice in one token's top-k (an all-zero MoE row is named "missing").

Work is done in blocks of rows so each decoded int32 block is checked and compacted while it
is still in cache; base64 strings are decoded block by block (row-aligned, 4-char aligned).
"""
import numpy as np

from .codec import INT32, b64_decode, b64_decoded_size, decode_int32
from .dupcheck import DupChecker
from rollout.errors import RoutedExpertsError
from .layout import MoELayout

BLOCK_BYTES = 1 << 18  # int32 bytes per block (256 KiB: stays in L2)


def expected_rows(num_tokens: int, start_len: int) -> int:
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
        raise RoutedExpertsError(f"len(tokens)={num_tokens!r} must be a positive int")
    if not isinstance(start_len, (int, np.integer)) or isinstance(start_len, bool) or not 0 <= start_len <= num_tokens - 1:
        raise RoutedExpertsError(f"routed_experts_start_len={start_len!r} outside [0, len(tokens)-1={num_tokens - 1}]")
    return num_tokens - 1 - start_len


def decode_compact(payload, layout: MoELayout, num_tokens: int, start_len: int = 0) -> np.ndarray:
    """SGLang payload -> validated compact array ``[len(tokens)-1-start_len, num_moe_layers, topk]``.

    ``num_tokens`` is ``len(sample.tokens)`` with the response already appended (as slime does).
    Raises ``RoutedExpertsError`` with a one-line reason.
    """
    rows = expected_rows(num_tokens, start_len)
    L, K = layout.num_hidden_layers, layout.topk
    if isinstance(payload, str):
        _check_size(b64_decoded_size(payload), rows, layout, start_len)
        source = _B64Rows(payload, L * K * 4)
    else:
        flat = decode_int32(payload)
        _check_size(flat.size * 4, rows, layout, start_len)
        source = _ArrayRows(flat.reshape(-1, L, K))
    out = np.empty((rows, layout.num_moe_layers, K), dtype=layout.compact_dtype)
    checker = _BlockChecker(layout)
    block = max(1, BLOCK_BYTES // (L * K * 4))
    block -= block % 3 if block >= 3 else 0  # 3 rows are always a whole number of base64 quanta
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        checker.check(source.rows(r0, r1), out[r0:r1], r0, start_len)
    return out


def _check_size(n_bytes: int, rows: int, layout: MoELayout, start_len: int) -> int:
    """The payload's value count; whole rows ``[0, rows)`` are read from it.

    One row more than expected is the stop-edge row: the routing of the final token, which an engine
    that forwarded that token too appends (Miles drops such a row) and which
    feeds no training position. The reviewed SGLang releases do not send it (`get_topk` stops at
    ``seqlen - 1``); it is dropped, not failed. With ``start_len == 1`` one extra row is also what a
    whole-sequence payload (start ignored) has, so that case still fails.
    """
    L, K = layout.num_hidden_layers, layout.topk
    if n_bytes % 4:
        raise RoutedExpertsError(f"routed_experts decodes to {n_bytes} bytes, not a multiple of 4 (int32)")
    n = n_bytes // 4
    if n == rows * L * K or (n == (rows + 1) * L * K and start_len != 1):
        return n
    if n == 0:
        raise RoutedExpertsError(f"routed_experts is empty, expected {rows} rows")
    if n % (L * K):
        if rows and n % (rows * K) == 0:
            raise RoutedExpertsError(
                f"routed_experts carries {n // (rows * K)} layers per token, model has {L} (extra or draft layer?)")
        raise RoutedExpertsError(f"routed_experts has {n} values, not a multiple of num_hidden_layers*topk={L}*{K}")
    got = n // (L * K)
    hint = " (covers the whole sequence: routed_experts_start_len ignored?)" if start_len and got == rows + start_len else ""
    raise RoutedExpertsError(f"routed_experts has {got} rows, expected len(tokens)-1-start_len={rows}{hint}")


class _B64Rows:
    def __init__(self, s: str, row_bytes: int):
        self.s, self.row_bytes = s, row_bytes

    def rows(self, r0, r1):
        c0, c1 = r0 * self.row_bytes // 3 * 4, -(-r1 * self.row_bytes // 3) * 4
        raw = b64_decode(self.s[c0:c1])
        skip = r0 * self.row_bytes - c0 // 4 * 3
        if len(raw) < skip + (r1 - r0) * self.row_bytes:
            raise RoutedExpertsError("routed_experts is not valid base64 (padding inside the string)")
        arr = np.frombuffer(raw, dtype=INT32, count=(r1 - r0) * self.row_bytes // 4, offset=skip)
        return arr.reshape(r1 - r0, -1)


class _ArrayRows:
    def __init__(self, full):
        self.full = full

    def rows(self, r0, r1):
        return self.full[r0:r1].reshape(r1 - r0, -1)


class _BlockChecker:
    def __init__(self, layout: MoELayout):
        self.layout = layout
        self.dups = DupChecker(layout.topk, layout.compact_dtype)
        L, K = layout.num_hidden_layers, layout.topk
        sl = layout.moe_slice
        if sl is not None:
            self.moe = slice(sl.start * K, sl.stop * K)
            self.dense = [s for s in (slice(0, sl.start * K), slice(sl.stop * K, L * K)) if s.stop > s.start]
        else:
            cols = np.arange(L * K).reshape(L, K)
            self.moe = cols[list(layout.moe_layers)].ravel()
            self.dense = [cols[list(layout.dense_layers)].ravel()] if layout.dense_layers else []

    def check(self, block: np.ndarray, out: np.ndarray, row0: int, start_len: int):
        """block: int32 ``[b, L*K]``; out: compact ``[b, M, K]`` to fill."""
        lay = self.layout
        for d in self.dense:
            if block[:, d].any():
                self._fail_dense(block, row0, start_len)
        moe = block[:, self.moe]
        if moe.size and moe.view(np.uint32).max() >= lay.num_experts:  # negative ids wrap to huge
            self._fail_range(moe, row0, start_len)
        out.reshape(out.shape[0], -1)[...] = moe
        if self.dups.has_duplicates(out):
            self._fail_dup(out, row0, start_len)

    def check_compact(self, arr: np.ndarray, row0: int, start_len: int):
        """arr: compact ``[b, M, K]`` as it came (uint8/int16): ids in range, no id twice."""
        unsigned = arr.view(np.uint8 if arr.dtype.itemsize == 1 else np.uint16)   # negative int16 wraps to huge
        if arr.size and unsigned.max() >= self.layout.num_experts:
            self._fail_range(arr.reshape(arr.shape[0], -1).astype(np.int32), row0, start_len)
        if self.dups.has_duplicates(arr):
            self._fail_dup(arr, row0, start_len)

    # Failure paths: locate the first bad (token, layer) for the message. Only run on bad data.
    def _fail_dense(self, block, row0, start_len):
        full = block.reshape(block.shape[0], self.layout.num_hidden_layers, -1)
        dense = list(self.layout.dense_layers)
        r, j = np.argwhere(full[:, dense].any(-1))[0]
        raise RoutedExpertsError(
            f"dense layer {dense[j]} carries expert ids {full[r, dense[j]].tolist()} at token {start_len + row0 + r}"
            " (draft/extra-layer leakage?)")

    def _fail_range(self, moe, row0, start_len):
        lay = self.layout
        m = moe.reshape(moe.shape[0], lay.num_moe_layers, lay.topk)
        r, j, k = np.argwhere((m < 0) | (m >= lay.num_experts))[0]
        v = int(m[r, j, k])
        what = "negative expert id" if v < 0 else "expert id"
        bound = "" if v < 0 else f" >= num_experts={lay.num_experts}"
        raise RoutedExpertsError(f"{what} {v}{bound} at token {start_len + row0 + r}, layer {lay.moe_layers[j]}")

    def _fail_dup(self, out, row0, start_len):
        s = np.sort(out, axis=-1)
        r, j = np.argwhere((s[..., 1:] == s[..., :-1]).any(-1))[0]
        token, layer = start_len + row0 + r, self.layout.moe_layers[j]
        if not out[r, j].any():
            raise RoutedExpertsError(f"MoE layer {layer} has no routing (all zeros) at token {token}: capture missing?")
        raise RoutedExpertsError(f"duplicate expert id in top-k {out[r, j].tolist()} at token {token}, layer {layer}")
