"""SGLang 0.5.20 (PyPI wheel; Miles' pending bump).

0.5.19's hooked source except `prepare_mlp_sync_batch` (re-pinned; the same BEFORE hook).
CPU family: 0.5.23's sources for the host cache (BaseHostCache goes through `_cuda_host_register`),
the AMX fallback, `moe_forward_native`, `all_gatherv` and the thread binding; `reduce_scatterv` and
`all_gather_into_tensor` moved (not ported: refused in a CPU engine). CPU graph replay: not ported.
compact-routed-experts: 0.5.23's sources (`get_internal_state` reworded).
"""
from sglang_patches.fixes import draft_token_count as dtc, verify_padding_lcm as vpl
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.fixes import tokenizer_workers as tw
from sglang_patches.registry import NOT_PORTED, Port, same_as

from . import FIX_TEST

PORTS = {
    "capturer-extent": same_as("v0_5_19"),
    "routed-experts-rows": same_as("v0_5_19"),
    "draft-extend-real-rows": same_as("v0_5_19"),
    "verify-padding-lcm": Port({vpl.ALIGN: "dd76cb3f2ae1c99a"}, test=FIX_TEST),
    "capture-snapshot": same_as("v0_5_19"),
    "dp-buffer-sizing": same_as("v0_5_15"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_15"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT_GLOBAL: "e2dc59752e4be5b1"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": same_as("v0_5_19"),
    "retraction-routes": Port({rro.PLAN: "e81d7476d643abe9", rro.FORCE: "88c941e724102603",
                               rro.OWN_PREFIX: "52dbca1f4a29a9fb"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "f4822939e280a0aa",
                                 wup.FLUSH_PAUSED: "7d4415b07b4b7b9a"}),
    "tokenizer-workers": Port({tw.LOAD: "b4607c4fe1da25e9"}),
    # CPU family
    "cpu-host-register": same_as("v0_5_23"),
    "cpu-cuda-synchronize": same_as("v0_5_23"),
    "cpu-eagle-attn-backend": same_as("v0_5_23"),
    "cpu-torch-native-fill": same_as("v0_5_23"),
    "cpu-ep-native-moe": same_as("v0_5_23"),
    "cpu-gloo-scatter-gather": NOT_PORTED,
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
