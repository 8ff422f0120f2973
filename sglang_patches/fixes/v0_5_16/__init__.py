"""Ports of the DP-attention fix set to SGLang 0.5.16 (Miles), stock PyPI wheel.

Each verdict is proven on 0.5.16's real code by `tests/dp_scenarios_v0_5_16.py` (stock fails with
the specific defect, SGLang's own `load_plugins()` + these hooks pass): tests/test_version_matrix.py.
Where 0.5.16's code differs from 0.5.23's the hooks live in this package: no
`get_schedule/get_exec/max_speculative_num_draft_tokens()` (numbers come from the published
ServerArgs; `dp_size` stays the DP width), no real-rows path for padded extends
(`graph_utils.padded_extend_real_tokens`): `draft-extend-real-rows` uses 0.5.15's hook on
`RadixAttention.forward` (0.5.16 also plans eager draft extend before the MLP-sync padding and marks
it ready without `replan_equivalent`, so it is never re-planned). `capturer-extent` keeps 0.5.23's
hooks: both targets have 0.5.23's signatures and every caller passes `padded_num_tokens` by keyword.
"""
from sglang_patches.fixes import capture_snapshot as cs, capturer_extent as ce, verify_padding_lcm as vp
from sglang_patches.fixes.v0_5_15 import draft_extend_real_rows as de
from sglang_patches.registry import Hook, Port

from . import routed_experts_rows as rr

V = "0.5.16"
MATRIX = "tests/test_version_matrix.py::test_fix_on_variant"
RADIX_FORWARD = "sglang.srt.layers.radix_attention.RadixAttention.forward"
RE_INIT = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer.__init__"
PREPARE_MLP_SYNC = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch"
GUARDS = "tests/test_version_matrix.py::test_guard_on_variant"

PORTS = {
    "capturer-extent": {V: Port(
        hooks=(Hook(ce.FILL_FROM, ce.record_extent, "before"), Hook(ce.ON_FORWARD_END, ce.use_executed_extent)),
        fingerprints={ce.FILL_FROM: "d51386f193d20925", ce.ON_FORWARD_END: "fd77ad70640d5781"},
        test=MATRIX)},
    "routed-experts-rows": {V: Port(
        hooks=(Hook(RE_INIT, rr.grow_buffer),), fingerprints={RE_INIT: "0de345206efde7bb"}, test=MATRIX)},
    "draft-extend-real-rows": {V: Port(
        hooks=(Hook(RADIX_FORWARD, de.attention_on_planned_rows),), fingerprints={RADIX_FORWARD: "fc2146f2662a02d7"},
        test=MATRIX)},
    "verify-padding-lcm": {V: Port(
        hooks=(Hook(PREPARE_MLP_SYNC, vp.align_to_whole_requests, "before"),),
        fingerprints={PREPARE_MLP_SYNC: "9bea5bf3a923f247"}, test=MATRIX)},
    "capture-snapshot": {V: Port(
        hooks=(Hook(cs.ON_FORWARD_END, cs.snapshot_output, "after"),),
        fingerprints={cs.ON_FORWARD_END: "fd77ad70640d5781"}, test=MATRIX)},
    "dp-buffer-sizing": {V: Port(
        state="not-needed", test=GUARDS,
        reason="0.5.16 has no dp_slot_in and indexes per-rank lists by DP rank (IndexError on a one-entry "
               "list), but no supported configuration reads one: with moe_a2a_backend none the MLP TP "
               "gather keeps full lists; with deepep + moe_dense_tp 1 + dp-lm-head every layer stays "
               "SCATTERED/TP_ATTN_FULL, the logits DP gather is off and the capturer takes its deepep slice")},
    "verify-logits-truncation": {V: Port(
        state="upstream", test=GUARDS, reason="SGLang 0.5.16 truncates in post_forward_mlp_sync_batch")},
    "heartbeat-reset": {V: Port(
        state="upstream", test=GUARDS, reason="SGLang 0.5.16's /health_generate needs a message newer than the probe")},
}
