"""SGLang 0.5.17 (PyPI wheel; slime's next image).

0.5.16's hooked source for capturer-extent, capture-snapshot and most of the CPU family. The capturer
sizes its buffer from `get_schedule()` and `get_parallel().dp_size` but 0.5.17 has no
`max_speculative_num_draft_tokens()`: the hook reads the published ServerArgs, as on 0.5.16.
CPU family: `moe_forward_native` moved (not ported: a CPU engine with EP refuses it).
"""
from sglang_patches.fixes import (draft_extend_real_rows as de, draft_token_count as dtc, routed_experts_rows as rer,
                                  verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.fixes import tokenizer_workers as tw
from sglang_patches.registry import NOT_PORTED, Port, same_as

from . import FIX_TEST

PORTS = {
    "capturer-extent": same_as("v0_5_15"),
    "routed-experts-rows": Port({rer.GROW_PUBLISHED_ARGS: "957a611caa58a06a"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "eac55d011907e247"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "ab51259e5e4bafbb"}, test=FIX_TEST),
    "capture-snapshot": same_as("v0_5_15"),
    "dp-buffer-sizing": same_as("v0_5_15"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_15"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT: "c47ef29026e9130f"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": same_as("v0_5_16"),
    "retraction-routes": Port({rro.PLAN: "af728442e936b53c", rro.FORCE: "0dd7a28e1b9b7c18",
                               rro.OWN_PREFIX: "d4331967c8e9c257"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "0f1a80fb39ea1580",
                                 wup.FLUSH_PAUSED: "329b21dd4c3abcf5"}),
    "tokenizer-workers": Port({tw.LOAD: "2e3fa3776d38713a"}),
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
