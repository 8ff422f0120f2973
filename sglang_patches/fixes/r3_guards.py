"""R3 defects reported near the fix set that SGLang 0.5.23 does not let into a request's payload.

Guard tests only, no hooks (state "not-needed" in `patches status`: the defective order is in
SGLang, but what it captures cannot reach a request).

- `padding-rows-capture` (sglang#36404): 0.5.23, 0.5.16 and 0.5.15.post1 (stock and slime's) capture top-k before the padded-region mask,
  but the host copy writes padded rows to the reserved KV slot 0 (MLP-sync pads `out_cache_loc`
  with zeros), which no request's `req_to_token` holds.
"""
from sglang_patches.registry import Fix, Port

PADDING_ROWS = ("captured before the padded-region mask, but padded rows are stored to the reserved KV slot 0, "
                "which no request's req_to_token holds")

FIXES = [
    Fix(
        name="padding-rows-capture",
        family="dp-attention",
        defect="sglang#36404: routed experts are captured before the padded-region mask. In 0.5.23 padded "
        "rows reach the device buffer only; the host copy sends them to the reserved slot 0, never to a payload.",
        reference="sglang#36404 (merged upstream after 0.5.23); findings §4",
        test="tests/test_r3_padding_rows_guard.py::test_padding_rows_capture_guard",
        ports={v: Port(state="not-needed", reason=PADDING_ROWS)
               for v in ("0.5.23", "0.5.16", "0.5.15.post1", "0.5.15.post1+slime")},
    ),
]
