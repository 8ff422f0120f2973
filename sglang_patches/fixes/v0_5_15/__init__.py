"""The fix set on SGLang 0.5.15.post1: the stock wheel and slime's image (the wheel + slime's patches).

`PORTS = {fix name: {variant name: Port}}`, merged into the fixes by `registry.all_fixes()`.
Hooks whose code differs from 0.5.23 live in this package's submodules (one per fix) and reuse
the fix module's shared logic. slime's patches change none of the hooked functions (same
fingerprints on both variants); they are told apart by `ModelRunner.forward` (registry.VARIANTS).
"""
from sglang_patches.fixes import capture_snapshot as cs, capturer_extent as ce, verify_padding_lcm as vpl
from sglang_patches.registry import Hook, Port

from . import draft_extend_real_rows as de, routed_experts_rows as rer

STOCK, SLIME = "0.5.15.post1", "0.5.15.post1+slime"
RE_INIT = "sglang.srt.state_capturer.routed_experts.RoutedExpertsCapturer.__init__"
MLP_SYNC = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch"
RADIX_FORWARD = "sglang.srt.layers.radix_attention.RadixAttention.forward"
TEST = "tests/test_version_matrix.py::test_fix_on_variant"
GUARD_TEST = "tests/test_version_matrix.py::test_guard_on_variant"

_hooked = {
    "capturer-extent": Port(
        hooks=(Hook(ce.FILL_FROM, ce.record_extent, "before"), Hook(ce.ON_FORWARD_END, ce.use_executed_extent)),
        fingerprints={ce.FILL_FROM: "d51386f193d20925", ce.ON_FORWARD_END: "fd77ad70640d5781"}, test=TEST),
    "routed-experts-rows": Port(hooks=(Hook(RE_INIT, rer.grow_buffer),),
                                fingerprints={RE_INIT: "5146728cf1943c61"}, test=TEST),
    "draft-extend-real-rows": Port(hooks=(Hook(RADIX_FORWARD, de.attention_on_planned_rows),),
                                   fingerprints={RADIX_FORWARD: "62a6ec3709f7bc5f"}, test=TEST),
    "verify-padding-lcm": Port(hooks=(Hook(MLP_SYNC, vpl.align_to_whole_requests, "before"),),
                               fingerprints={MLP_SYNC: "3ec4976a5007386c"}, test=TEST),
    "capture-snapshot": Port(hooks=(Hook(cs.ON_FORWARD_END, cs.snapshot_output, "after"),),
                             fingerprints={cs.ON_FORWARD_END: "fd77ad70640d5781"}, test=TEST),
}
_guards = {
    "dp-buffer-sizing": Port(state="not-needed", test=GUARD_TEST, reason=(
        "0.5.15 has no dp_slot_in and indexes one-entry per-rank lists by DP rank (IndexError), but no "
        "shipped config reaches it: with moe_a2a_backend none every rank gathers the full list "
        "(require_mlp_tp_gather), with deepep + moe_dense_tp 1 every layer stays scattered")),
    "verify-logits-truncation": Port(state="upstream", test=GUARD_TEST,
                                     reason="0.5.15 truncates padded verify logits in post_forward_mlp_sync_batch"),
    "heartbeat-reset": Port(state="upstream", test=GUARD_TEST,
                            reason="0.5.15's /health_generate needs a message newer than the probe"),
}
PORTS = {name: {STOCK: port, SLIME: port} for name, port in {**_hooked, **_guards}.items()}
