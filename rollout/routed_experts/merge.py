"""The one routed-experts call per SGLang answer: decode, validate, refuse retracted routes, merge segments.

Both formats are taken: SGLang's int32 (``validate``) and, when ``meta_info`` states its layout, the
compact one an engine with the plugin's feature sends to requests that asked for it (``wire``).

The dispatcher calls ``sample_routed_experts`` for every answer of a sample that asked for routed
experts, whichever caller (the rollout manager's groups, the slime adapter's single samples) sent it.
A continued request sends ``routed_experts_start_len = S`` (SGLang: "response covers
``[S, seqlen - 1)``"); its payload holds rows ``[S, len(tokens) - 1)``, and rows ``[0, S)`` come
from the segment already held (``continuation_start`` says which S to send).
"""
from collections.abc import Mapping
from typing import Optional

import numpy as np

from rollout.errors import RoutedExpertsError

from .layout import MoELayout
from .retraction import retraction_reason
from .validate import decode_compact
from .wire import LAYOUT_KEY, decode_wire, unsplit_header


def continuation_start(held, num_tokens: int) -> int:
    """The ``routed_experts_start_len`` to send for a sample of ``num_tokens`` tokens holding ``held``:
    the rows already held (none held: 0, the whole sequence is asked for again)."""
    return 0 if held is None else min(int(held.shape[0]), max(0, num_tokens - 1))


def merge_segments(held, new: np.ndarray, start_len: int) -> np.ndarray:
    """``held[:start_len] ++ new`` (compact arrays). ``held`` may be None when ``start_len == 0``."""
    if start_len == 0:
        return new
    if held is None:
        raise RoutedExpertsError(f"routed_experts_start_len={start_len} but no earlier segment is held")
    if held.shape[0] < start_len:
        raise RoutedExpertsError(
            f"routed_experts_start_len={start_len} exceeds the {held.shape[0]} rows already held")
    if held.shape[1:] != new.shape[1:] or held.dtype != new.dtype:
        raise RoutedExpertsError(f"held segment {held.shape}/{held.dtype} does not match new {new.shape}/{new.dtype}")
    return np.concatenate([held[:start_len], new])


def sample_routed_experts(meta_info: dict, num_tokens: int, layout: MoELayout, held=None, start_len=None,
                          sent_version: Optional[str] = None):
    """The sample's routed experts after one answer. Never raises for bad data.

    ``num_tokens``: ``len(sample.tokens)`` including the new response. ``start_len``: the
    ``routed_experts_start_len`` sent with the request (default: ``meta_info``'s, else 0; SGLang
    0.5.23 does not echo it). ``held``: the compact array from the earlier segment, if any.
    ``sent_version``: the engine's weight version when the request was sent (retraction check).
    Returns ``(compact, None)`` or ``(None, one_line_reason)``; on a reason, mark the sample failed.
    """
    try:
        if not isinstance(meta_info, Mapping):
            raise RoutedExpertsError(f"meta_info is a {type(meta_info).__name__}, expected a dict")
        reason = retraction_reason(meta_info, sent_version)   # miles#3277: routes recomputed under newer weights
        if reason:
            raise RoutedExpertsError(reason)
        if start_len is None:
            start_len = meta_info.get("routed_experts_start_len", 0) or 0
        payload, wire = meta_info.get("routed_experts"), meta_info.get(LAYOUT_KEY)
        if wire is not None:
            new = decode_wire(payload, wire, layout, num_tokens, start_len)
        else:
            half = unsplit_header(payload)
            if half:
                raise RoutedExpertsError(half)
            new = decode_compact(payload, layout, num_tokens, start_len)
        return merge_segments(held, new, start_len), None
    except RoutedExpertsError as e:
        return None, str(e)
