"""SGLang 0.5.19 (PyPI wheel; Miles since its v0.5.19 bump).

The capturer reads its sizing from the config bags (`get_schedule`, `get_parallel().dp_size`); no real-rows
path for padded extends (draft extend is hooked on `RadixAttention.forward`); `on_forward_end` already
snapshots its deferred output (sglang#34319, since 0.5.18); no `dp_slot_in` (dp-buffer-sizing not-needed,
as on 0.5.16).
CPU family: 0.5.23's `_cuda_host_register` and AMX fallback, but the routed-experts host cache still pins
its own buffer (both hooks); `moe_forward_native`, `all_gather_into_tensor` and `init_threads_binding`
differ from 0.5.23's in lines the hooks do not depend on (same signatures, same CPU branch): re-pinned.
CPU graph replay: 0.5.23's hook points (the torch_native graph switch-off, the CPU decode-runner early
return, the backend resolvers, the runner's device module) with other source around them: re-pinned;
the attention-backend and pynccl targets are 0.5.23's; DP attention's row copy has its CPU branch and
the DP token counts are pinned only where pinning is available (upstream).
compact-routed-experts: the scheduler reads `req.kv.req_pool_idx`; `_wait_one_response` returns an async
generator (both as on 0.5.23).
"""
from sglang_patches.cpu.fixes import (ep_native_moe as epm, gloo_stacked_allgather as gsa, host_register as hr,
                                      thread_binding as tb)
from sglang_patches.cpu.graphs import decode_runner as dr, graph_config as gc, replay_backend as rb
from sglang_patches.features import routed_experts_wire as w
from sglang_patches.fixes import (capturer_extent as ce, draft_extend_real_rows as de, draft_token_count as dtc,
                                  routed_experts_rows as rer, verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.fixes import tokenizer_workers as tw
from sglang_patches.registry import Port, same_as
from sglang_patches.states import FixState

from . import ENGINE_TEST_0_5_15, FIX_TEST, GUARD_TEST

ENGINE_TEST = "tests/test_engine_versions.py::test_c_routed_experts_match_transformers"
GRAPHS_TEST = "tests/test_engine_versions.py::test_c_graphs_with_the_fix_set_match_transformers"
PORTS = {
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "91c7a85d21e49199"},
                            test=FIX_TEST),
    "routed-experts-rows": Port({rer.GROW_DP_SIZE: "5b505564668a5480"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "16cf2680a022d2b2"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "ec8ae0863594cd9a"}, test=FIX_TEST),
    "capture-snapshot": Port(state=FixState.UPSTREAM, test=GUARD_TEST,
                             reason="on_forward_end clones out_cache_loc and the top-k slice (sglang#34319)"),
    "dp-buffer-sizing": same_as("v0_5_15"),
    "verify-logits-truncation": same_as("v0_5_15"),
    "heartbeat-reset": same_as("v0_5_15"),
    "prefill-graph-buckets": same_as("v0_5_15"),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT: "d371f05cb690ec0a"}, test=FIX_TEST),
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": Port({rr.KEEP: "52dbca1f4a29a9fb", rr.SPLICE: "0a42f229acf94e72", rr.STATE: "153426e70898ed8b"}),
    "retraction-routes": Port({rro.PLAN: "2a00c5a8a9829f81", rro.FORCE: "ec7e6abd996c6022",
                               rro.OWN_PREFIX: "52dbca1f4a29a9fb"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "0d3dc8a3d516ad03",
                                 wup.FLUSH_PAUSED: "7d4415b07b4b7b9a"}),
    "tokenizer-workers": Port({tw.LOAD: "66ceeea7d321eba3"}),
    # CPU family
    "cpu-host-register": Port({hr.SKIP_REGISTER: "f13fb8ab7ebf962a", hr.UNPINNED_HOST_CACHE: "24c16491a52570c3"},
                              test=ENGINE_TEST_0_5_15),
    "cpu-cuda-synchronize": same_as("v0_5_23"),
    "cpu-eagle-attn-backend": same_as("v0_5_23"),
    "cpu-torch-native-fill": same_as("v0_5_23"),
    "cpu-ep-native-moe": Port({epm.LOCAL_IDS: "e94e6fac5846d0a0"}, test=ENGINE_TEST),
    "cpu-gloo-scatter-gather": same_as("v0_5_15"),
    "cpu-gloo-stacked-allgather": Port({gsa.FLAT_OUTPUT: "b30e73116f520e1e"}, test=ENGINE_TEST),
    "cpu-thread-binding": Port({tb.BIND: "90027a95f128629b"}, test=ENGINE_TEST),
    "cpu-dp-controller-idle": same_as("v0_5_15"),
    # CPU graph replay
    "cpu-graphs-config": Port({gc.KEEP_GRAPH_CONFIG: "139ccda62b1df9e4"}, test=GRAPHS_TEST),
    "cpu-graphs-decode-runner": Port({dr.BUILD_DECODE_RUNNER: "7e704c83d4a1971e", dr.GRAPH_MODES: "c7880625d0ba90ef"},
                                     test=GRAPHS_TEST),
    "cpu-graphs-replay-backend": Port({rb.DECODE_BACKEND: "2b2ff193eccc102a", rb.PREFILL_BACKEND: "ead10daf6528b717",
                                       rb.DEVICE_MODULE: "04f5a7e98fcc063a"}, test=GRAPHS_TEST),
    "cpu-graphs-attn-backend": same_as("v0_5_23"),
    "cpu-graphs-pynccl-state": same_as("v0_5_23"),
    "cpu-graphs-dp-memcpy": same_as("v0_5_23"),
    "cpu-graphs-mlp-sync-pin": same_as("v0_5_23"),
    # opt-in feature
    "compact-routed-experts": Port({w.COMPACT: "0a42f229acf94e72", w.SPLIT: "153426e70898ed8b",
                                    w.ADVERTISE: "88e5d21b6395d8e9"}),
}
