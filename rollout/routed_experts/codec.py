"""Decode SGLang's ``meta_info["routed_experts"]`` and convert between layouts.

Wire format (SGLang 0.5.23, ``--enable-return-routed-experts``): a base64 string of
little-endian int32, C order ``[len(tokens) - 1 - start_len, num_hidden_layers, topk]``.
Row i is the routing of token ``start_len + i``; the last token has no row. Dense layers are
included and are all zeros. ``bytes``/``bytearray``/``memoryview`` are taken as the raw int32
buffer (before base64); lists, numpy arrays and torch tensors as the values themselves.

Compact format (what this package hands to the trainer): a C-contiguous numpy array
``[rows, num_moe_layers, topk]``, dtype uint8 when ``num_experts <= 256`` else int16.
Column j is the j-th MoE layer in model order (``layout.moe_layers[j]`` is its layer index);
dense layers are dropped. GLM-4.5: 89 x 8 x 1 B = 712 B per token instead of 92 x 8 x 4 = 2944.
"""
import binascii

import numpy as np
import pybase64

from rollout.errors import RoutedExpertsError
from .layout import MoELayout

INT32 = np.dtype("<i4")


def b64_decoded_size(s: str) -> int:
    """Bytes a strict base64 string decodes to, from its length and padding alone."""
    if not s.isascii():
        raise RoutedExpertsError("routed_experts is not valid base64 (non-ASCII characters)")
    if len(s) % 4:
        raise RoutedExpertsError(f"routed_experts is not valid base64 (length {len(s)} is not a multiple of 4)")
    return len(s) // 4 * 3 - (len(s) >= 1 and s[-1] == "=") - (len(s) >= 2 and s[-2] == "=")


def b64_decode(s: str) -> bytes:
    """Strict base64 decode (rejects any character outside the alphabet), one-line error."""
    try:
        return pybase64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutedExpertsError(f"routed_experts is not valid base64 ({str(e).splitlines()[0][:80]})") from None


def decode_int32(payload) -> np.ndarray:
    """Any accepted payload -> flat int32 numpy array (a zero-copy view where possible)."""
    if isinstance(payload, str):
        raw = b64_decode(payload)
    elif isinstance(payload, (bytes, bytearray, memoryview)):
        raw = payload
    elif isinstance(payload, np.ndarray) or type(payload).__module__.startswith("torch"):
        arr = payload.detach().cpu().numpy() if hasattr(payload, "detach") else payload
        if arr.dtype.kind not in "iu":
            raise RoutedExpertsError(f"routed_experts array has dtype {arr.dtype}, expected integers")
        return _to_int32(arr.reshape(-1))
    elif isinstance(payload, (list, tuple)):
        try:
            arr = np.asarray(payload) if len(payload) else np.zeros(0, INT32)
        except ValueError:
            raise RoutedExpertsError("routed_experts list is ragged (rows of different lengths)") from None
        if arr.dtype.kind not in "iu":
            raise RoutedExpertsError(f"routed_experts list holds {arr.dtype} values, expected integers")
        return _to_int32(arr.reshape(-1))
    elif payload is None:
        raise RoutedExpertsError("routed_experts is missing (was return_routed_experts set on the request?)")
    else:
        raise RoutedExpertsError(f"routed_experts has unsupported type {type(payload).__name__}")
    if len(raw) % 4:
        raise RoutedExpertsError(f"routed_experts decodes to {len(raw)} bytes, not a multiple of 4 (int32)")
    return np.frombuffer(raw, dtype=INT32)


def _to_int32(arr: np.ndarray) -> np.ndarray:
    if arr.size and (arr.min() < np.iinfo(INT32).min or arr.max() > np.iinfo(INT32).max):
        raise RoutedExpertsError("routed_experts holds values outside int32")
    return arr.astype(INT32, copy=False)


def compact(full: np.ndarray, layout: MoELayout) -> np.ndarray:
    """``[rows, num_hidden_layers, topk]`` int -> compact ``[rows, num_moe_layers, topk]`` (no checks)."""
    sl = layout.moe_slice
    moe = full[:, sl, :] if sl is not None else full[:, list(layout.moe_layers), :]
    return np.ascontiguousarray(moe, dtype=layout.compact_dtype)


def expand(compact_arr: np.ndarray, layout: MoELayout, dtype=INT32) -> np.ndarray:
    """Compact -> ``[rows, num_hidden_layers, topk]`` with zeros in dense layers (SGLang's layout)."""
    rows = compact_arr.shape[0]
    full = np.zeros((rows, layout.num_hidden_layers, layout.topk), dtype=dtype)
    sl = layout.moe_slice
    full[:, sl if sl is not None else list(layout.moe_layers), :] = compact_arr
    return full


def encode_sglang(full: np.ndarray) -> str:
    """int ``[rows, num_hidden_layers, topk]`` -> SGLang's base64 int32 string (for tests and tools)."""
    return pybase64.b64encode(np.ascontiguousarray(full, dtype=INT32).tobytes()).decode("ascii")
