"""SGLang 0.5.18 (PyPI wheel; Miles' v0.5.18 bump).

0.5.17's hooked source for draft extend, verify padding and the CPU family; 0.5.19's `on_forward_end`
(capturer-extent's pins, and sglang#34319 upstream); the capturer's `__init__` is 0.5.17's, but the module
no longer imports `get_server_args`: the config-bag hook (DP width `get_parallel().dp_size`).
"""
from sglang_patches.fixes import draft_token_count as dtc, routed_experts_rows as rer
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.fixes import tokenizer_workers as tw
from sglang_patches.registry import NOT_PORTED, Port, same_as

from . import FIX_TEST

PORTS = {
    "capturer-extent": same_as("v0_5_19"),
    "routed-experts-rows": Port({rer.GROW_DP_SIZE: "957a611caa58a06a"}, test=FIX_TEST),
    "draft-extend-real-rows": same_as("v0_5_17"),
    "verify-padding-lcm": same_as("v0_5_17"),
    "capture-snapshot": same_as("v0_5_19"),
    "dp-buffer-sizing": same_as("v0_5_15"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_15"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT: "9a0c4387d3e0006f"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": Port({rr.KEEP_REQ_IDX: "caff2168f6734304", rr.SPLICE: "d5129896884dfd79",
                             rr.STATE: "ddde0e6b71c3e1cd"}),
    "retraction-routes": Port({rro.PLAN: "9f6338ab4b5cc3d8", rro.FORCE: "0dd7a28e1b9b7c18",
                               rro.OWN_PREFIX: "caff2168f6734304"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "6971b23c569722f0",
                                 wup.FLUSH_PAUSED: "329b21dd4c3abcf5"}),
    "tokenizer-workers": Port({tw.LOAD: "5b85af984cdb6570"}),
    # CPU family
    "cpu-host-register": same_as("v0_5_15"),
    "cpu-cuda-synchronize": same_as("v0_5_23"),
    "cpu-eagle-attn-backend": same_as("v0_5_15"),
    "cpu-torch-native-fill": same_as("v0_5_23"),
    "cpu-ep-native-moe": NOT_PORTED,
    "cpu-gloo-scatter-gather": same_as("v0_5_15"),
    "cpu-gloo-stacked-allgather": same_as("v0_5_15"),
    "cpu-thread-binding": same_as("v0_5_16"),
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
    "compact-routed-experts": same_as("v0_5_16"),
}
