"""SGLang 0.5.16 (PyPI wheel; Miles before its v0.5.18 bump).

Same hooked source as 0.5.15.post1 for capturer-extent, capture-snapshot and most of the CPU family;
the capturer sizing reads the runtime context's published ServerArgs; `numa_utils.init_threads_binding`
(tp_rank=, tp_size=) is hooked. compact-routed-experts: `_wait_one_response` reworded (the same up to 0.5.18).
"""
from sglang_patches.cpu.fixes import thread_binding as tb
from sglang_patches.features import routed_experts_wire as w
from sglang_patches.fixes import (draft_extend_real_rows as de, draft_token_count as dtc, routed_experts_rows as rer,
                                  verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.registry import NOT_PORTED, Port, same_as

from . import FIX_TEST

PORTS = {
    "capturer-extent": same_as("v0_5_15"),
    "routed-experts-rows": Port({rer.GROW_PUBLISHED_ARGS: "0de345206efde7bb"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "fc2146f2662a02d7"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "9bea5bf3a923f247"}, test=FIX_TEST),
    "capture-snapshot": same_as("v0_5_15"),
    "dp-buffer-sizing": same_as("v0_5_15"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_15"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT: "897f4db58ae3db2a"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": Port({rr.KEEP_REQ_IDX: "d4331967c8e9c257", rr.SPLICE: "d5129896884dfd79",
                             rr.STATE: "ddde0e6b71c3e1cd"}),
    "retraction-routes": Port({rro.PLAN: "f124fb309e6cc91b", rro.FORCE: "0dd7a28e1b9b7c18",
                               rro.OWN_PREFIX: "d4331967c8e9c257"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "6971b23c569722f0",
                                 wup.FLUSH_PAUSED: "329b21dd4c3abcf5"}),
    "tokenizer-workers": same_as("v0_5_15"),
    # CPU family
    "cpu-host-register": same_as("v0_5_15"),
    "cpu-cuda-synchronize": same_as("v0_5_23"),
    "cpu-eagle-attn-backend": same_as("v0_5_15"),
    "cpu-torch-native-fill": same_as("v0_5_23"),
    "cpu-ep-native-moe": same_as("v0_5_15"),
    "cpu-gloo-scatter-gather": same_as("v0_5_15"),
    "cpu-gloo-stacked-allgather": same_as("v0_5_15"),
    "cpu-thread-binding": Port({tb.BIND: "65ce8574b7efee2a"},
                               test="tests/test_engine_v0_5_15.py::test_thread_binding_on_0_5_16"),
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
    "compact-routed-experts": Port({w.COMPACT: "d5129896884dfd79", w.SPLIT: "ddde0e6b71c3e1cd",
                                    w.ADVERTISE: "88e5d21b6395d8e9"}),
}
