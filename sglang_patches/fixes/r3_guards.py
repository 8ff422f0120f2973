"""An R3 defect reported upstream that no reviewed SGLang lets into a request's payload.

Guard test only, no hooks (state "not-needed": the defective order is in SGLang, but what it
captures cannot reach a request).

- `padding-rows-capture` (sglang#36404): every reviewed release captures top-k before the
  padded-region mask, but the host copy writes padded rows to the reserved KV slot 0 (MLP-sync pads
  `out_cache_loc` with zeros), which no request's `req_to_token` holds.
"""
from sglang_patches.registry import Fix

FIXES = [
    Fix(
        name="padding-rows-capture",
        family="dp-attention",
        defect="sglang#36404: routed experts are captured before the padded-region mask. Padded rows reach "
        "the device buffer only; the host copy sends them to the reserved slot 0, never to a payload.",
        reference="sglang#36404 (merged upstream after 0.5.23)",
        test="tests/test_r3_padding_rows_guard.py::test_padding_rows_capture_guard",
    ),
]
