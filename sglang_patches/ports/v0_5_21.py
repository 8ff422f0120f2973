"""SGLang 0.5.21 (PyPI wheel).

`dp_slot_in` resolves one-entry per-rank lists (dp-buffer-sizing upstream, as on 0.5.23); the capturer's
`__init__` is 0.5.19's (config-bag hook, DP width `get_parallel().dp_size`); no real-rows path for padded
extends (draft extend hooked on `RadixAttention.forward`); `on_forward_end` snapshots (sglang#34319).
CPU family: 0.5.23's sources except `all_gather_into_tensor` (moved: not ported); the DP controller
process does not load plugins yet (not-needed, as up to 0.5.16). CPU graph replay: not ported.
compact-routed-experts: 0.5.23's sources.
"""
from sglang_patches.fixes import (capturer_extent as ce, draft_extend_real_rows as de, draft_token_count as dtc,
                                  verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.registry import NOT_PORTED, Port, same_as
from sglang_patches.states import FixState

from . import FIX_TEST, GUARD_TEST

PORTS = {
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "0a38d0e68ca93201"},
                            test=FIX_TEST),
    "routed-experts-rows": same_as("v0_5_19"),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "1da7ccd202fe0dfe"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "23415531c9f4d621"}, test=FIX_TEST),
    "capture-snapshot": same_as("v0_5_19"),
    "dp-buffer-sizing": Port(state=FixState.UPSTREAM, test=GUARD_TEST,
                             reason="one-entry per-rank lists are resolved via dp_slot_in"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_15"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT_GLOBAL: "a7e61b4cbd9bf676"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": Port({rr.KEEP: "8927d8193e9b876c", rr.SPLICE: "0a42f229acf94e72", rr.STATE: "153426e70898ed8b"}),
    "retraction-routes": Port({rro.PLAN: "8c6ed80ef5c4aad7", rro.FORCE: "341b770111507e5e",
                               rro.OWN_PREFIX: "8927d8193e9b876c"}),
    "weight-update-pause": same_as("v0_5_23"),
    "tokenizer-workers": same_as("v0_5_20"),
    # CPU family
    "cpu-host-register": same_as("v0_5_23"),
    "cpu-cuda-synchronize": same_as("v0_5_23"),
    "cpu-eagle-attn-backend": same_as("v0_5_23"),
    "cpu-torch-native-fill": same_as("v0_5_23"),
    "cpu-ep-native-moe": same_as("v0_5_23"),
    "cpu-gloo-scatter-gather": same_as("v0_5_23"),
    "cpu-gloo-stacked-allgather": NOT_PORTED,
    "cpu-thread-binding": same_as("v0_5_23"),
    "cpu-dp-controller-idle": same_as("v0_5_15"),
    # CPU graph replay
    "cpu-graphs-config": NOT_PORTED,
    "cpu-graphs-decode-runner": NOT_PORTED,
    "cpu-graphs-replay-backend": NOT_PORTED,
    "cpu-graphs-attn-backend": NOT_PORTED,
    "cpu-graphs-pynccl-state": NOT_PORTED,
    "cpu-graphs-dp-memcpy": NOT_PORTED,
    "cpu-graphs-mlp-sync-pin": NOT_PORTED,
    # opt-in feature
    "compact-routed-experts": same_as("v0_5_23"),
}
