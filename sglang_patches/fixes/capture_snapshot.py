"""Overlap scheduling: a forward's captured top-k rows are snapshot before the next forward runs.

Defect (0.5.15.post1 ... 0.5.17; sglang#34319, upstream since 0.5.18): with overlap scheduling (the
default) `BaseTopkCapturer.on_forward_end` returns a `TopkCaptureOutput` holding a *view* of the
reusable device cache (and the batch's `out_cache_loc`). Its D2H copy runs on the result-copy
stream, unordered with the next forward, which rewrites the cache rows in place; `record_stream`
keeps memory alive but cannot stop that. On CUDA this is a race; on CPU `_async_d2h` returns the
view itself, so `finalize()` (after the next forward) always stores the next forward's rows: a
request's routed experts come back wrong at prompt row 0 and at every decode row (measured on the
CPU engine).

Fix: AFTER `on_forward_end`: the returned output gets its own copies (on the forward stream, so
ordered before the next forward), as SGLang 0.5.23 does. The synchronous path returns None: unchanged.
"""
import dataclasses

from sglang_patches.registry import Fix, Hook

ON_FORWARD_END = "sglang.srt.state_capturer.base.BaseTopkCapturer.on_forward_end"


def snapshot_output(result, *args, **kwargs):
    """AFTER on_forward_end: detach the deferred output from buffers the next forward reuses."""
    if result is None:
        return None
    return dataclasses.replace(result, out_cache_loc=result.out_cache_loc.clone(), topk=result.topk.clone())


SNAPSHOT = Hook(ON_FORWARD_END, snapshot_output, "after")

FIX = Fix(
    name="capture-snapshot",
    family="dp-attention",
    defect=(
        "With overlap scheduling the deferred routed-experts output is a view of the device cache that "
        "the next forward rewrites before the host copy lands. Prompt row 0 and every decode row carry "
        "the next forward's experts (CUDA: a race, per sglang#34319; CPU: always)."
    ),
    reference="sglang#34319 (merged upstream; in 0.5.18 and later)",
    test="tests/test_version_matrix.py::test_fix_on_variant",
)
