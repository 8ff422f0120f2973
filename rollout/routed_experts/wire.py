"""The compact wire format (``sglang_patches.features.routed_experts_wire``) on the client side.

An engine with the plugin's ``compact-routed-experts`` feature sends the requests that ask for it
``meta_info["routed_experts"]`` = base64 of ``[rows, num_moe_layers, topk]`` uint8 (int16 above 256
experts) and ``meta_info["routed_experts_layout"]`` saying so. ``decode_wire`` checks that layout
against the model's (so dense layers are absent by construction, and the engine refused to drop a
layer that was not all zeros), the row count (the stop-edge row is dropped as for int32), and then,
as for int32 payloads: ids in ``[0, num_experts)``, no id twice in a top-k, no all-zero (missing)
routing. ``engine_offers`` reads an engine's ``/server_info`` advert; ``opt_in`` adds the request's
opt-in to its sampling params.
"""
from typing import Optional

import numpy as np
import pybase64

from rollout.errors import RoutedExpertsError
from sglang_patches.features.routed_experts_wire import ADVERT_KEY, LAYOUT_KEY, MAGIC_B64, STATIC_KEYS, layout_of, opt_in

from .codec import b64_decoded_size
from .layout import MoELayout
from .validate import BLOCK_BYTES, _BlockChecker, expected_rows

__all__ = ["LAYOUT_KEY", "decode_wire", "engine_offers", "opt_in", "wire_layout"]


def wire_layout(layout: MoELayout) -> dict:
    """The layout an engine must state for this model."""
    return layout_of(layout.num_hidden_layers, layout.moe_layers, layout.num_experts, layout.topk)


def engine_offers(server_info, layout: MoELayout) -> tuple[bool, str]:
    """(True, "") when every DP rank of the engine advertises this model's compact layout, else
    (False, why not): the caller then asks that engine for SGLang's int32 format."""
    states = server_info.get("internal_states") if isinstance(server_info, dict) else None
    if not isinstance(states, list) or not states:
        return False, "no internal_states in /server_info"
    want = wire_layout(layout)
    for s in states:
        got = s.get(ADVERT_KEY) if isinstance(s, dict) else None
        if not isinstance(got, dict):
            return False, "compact routed experts not advertised (no plugin feature on this engine)"
        if got.get("format") is None:
            return False, f"engine does not compact: {got.get('reason')}"
        diff = [k for k in STATIC_KEYS if got.get(k) != want[k]]
        if diff:
            k = diff[0]
            return False, f"engine's compact layout {k}={got.get(k)!r} differs from the model's {want[k]!r}"
    return True, ""


def decode_wire(payload, wire: dict, layout: MoELayout, num_tokens: int, start_len: int = 0) -> np.ndarray:
    """A compact answer -> validated compact array ``[len(tokens)-1-start_len, num_moe_layers, topk]``.
    Raises ``RoutedExpertsError`` with a one-line reason."""
    rows = expected_rows(num_tokens, start_len)
    if not isinstance(wire, dict):
        raise RoutedExpertsError(f"{LAYOUT_KEY} is a {type(wire).__name__}, expected a dict")
    want = wire_layout(layout)
    for k in STATIC_KEYS:
        if wire.get(k) != want[k]:
            raise RoutedExpertsError(f"{LAYOUT_KEY} {k}={wire.get(k)!r} does not match the model's {want[k]!r}")
    if not isinstance(payload, str):
        raise RoutedExpertsError(f"compact routed_experts is a {type(payload).__name__}, expected base64 text")
    dtype = layout.compact_dtype
    row_bytes = layout.num_moe_layers * layout.topk * dtype.itemsize
    n = b64_decoded_size(payload)
    if n % row_bytes:
        raise RoutedExpertsError(f"compact routed_experts decodes to {n} bytes, not whole rows of {row_bytes}")
    got = n // row_bytes
    if wire.get("rows") != got:
        raise RoutedExpertsError(f"{LAYOUT_KEY} says {wire.get('rows')!r} rows, the payload holds {got}")
    if got != rows and not (got == rows + 1 and start_len != 1):   # one more: the stop-edge row, dropped
        hint = " (covers the whole sequence: routed_experts_start_len ignored?)" if start_len and got == rows + start_len else ""
        raise RoutedExpertsError(f"routed_experts has {got} rows, expected len(tokens)-1-start_len={rows}{hint}")
    try:
        raw = pybase64.b64decode_as_bytearray(payload, validate=True)
    except ValueError as e:
        raise RoutedExpertsError(f"routed_experts is not valid base64 ({str(e).splitlines()[0][:80]})") from None
    arr = np.frombuffer(raw, dtype=dtype).reshape(got, layout.num_moe_layers, layout.topk)[:rows]
    checker = _BlockChecker(layout)
    block = max(1, BLOCK_BYTES // row_bytes)
    for r0 in range(0, rows, block):
        checker.check_compact(arr[r0:r0 + block], r0, start_len)
    return arr


def unsplit_header(payload) -> Optional[str]:
    """A reason when an int32-looking payload still carries the compact header (tokenizer hop not hooked)."""
    if isinstance(payload, str) and payload.startswith(MAGIC_B64):
        return f"routed_experts carries a compact header but meta_info has no {LAYOUT_KEY} (engine half-patched?)"
    return None
