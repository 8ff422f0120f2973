"""SGLang 0.5.22 (PyPI wheel).

0.5.23's `on_forward_end` and capturer `__init__` (its hooks and pins); 0.5.21's `prepare_mlp_sync_batch`;
no real-rows path for padded extends yet (draft extend hooked on `RadixAttention.forward`). Its DP
controller process loads plugins: cpu-dp-controller-idle as on 0.5.23. Otherwise 0.5.21's sources.
"""
from sglang_patches.fixes import capturer_extent as ce, draft_extend_real_rows as de, draft_token_count as dtc
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.registry import NOT_PORTED, Port, same_as

from . import FIX_TEST

PORTS = {
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "e289e633c1082b48"},
                            test=FIX_TEST),
    "routed-experts-rows": same_as("v0_5_23"),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "3b3d211412fd8c82"}, test=FIX_TEST),
    "verify-padding-lcm": same_as("v0_5_21"),
    "capture-snapshot": same_as("v0_5_19"),
    "dp-buffer-sizing": same_as("v0_5_21"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_23"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT_GLOBAL: "01b5d0ced0bda937"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": same_as("v0_5_23"),
    "retraction-routes": Port({rro.PLAN: "8bfc6d00f35c796c", rro.FORCE: "bca6b45583429e3c",
                               rro.OWN_PREFIX: "e9a690b5c7084bb5"}),
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
    "cpu-dp-controller-idle": same_as("v0_5_23"),
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
