"""SGLang 0.5.15.post1: the stock wheel and slime's image (the wheel + slime's patches), one table.

slime's patches change none of the hooked functions (same fingerprints on both); the variants are told
apart by `ModelRunner.forward` (registry.VARIANTS). No real-rows path for padded extends: draft extend
is hooked on `RadixAttention.forward`; the capturer sizing reads the global server args.
CPU graph replay: the runner/backend split of 0.5.23 (same backend resolvers, runner device module,
attention-backend and pynccl targets); the torch_native graph switch-off is a ServerArgs method and the CPU
decode-runner early return sits in `ModelRunner.init_decode_cuda_graph` (their own hooks); DP attention's
row copy is Triton-only (`dp_attention.memcpy_triton`) and its token counts are pinned on every device
(`prepare_mlp_sync_batch`): hooked by their own graph fixes.
compact-routed-experts: the scheduler's `_maybe_collect_routed_experts` reads `req.req_pool_idx` and the
tokenizer manager's `_wait_one_response` is an async generator (both up to 0.5.18).
"""
from sglang_patches.cpu.fixes import (dp_controller_idle as dci, eagle_attention_backend as eab, ep_native_moe as epm,
                                      gloo_stacked_allgather as gsa, gloo_varsize_collectives as gvc,
                                      host_register as hr)
from sglang_patches.cpu.graphs import (decode_runner as dr, dp_memcpy as dpm, graph_config as gc, mlp_sync_pin as msp,
                                       replay_backend as rb)
from sglang_patches.features import routed_experts_wire as w
from sglang_patches.fixes import (capture_snapshot as snap, capturer_extent as ce, draft_extend_real_rows as de,
                                  draft_token_count as dtc, routed_experts_rows as rer, verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import upstream_guards as ug
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.fixes import tokenizer_workers as tw
from sglang_patches.registry import Port, same_as
from sglang_patches.states import FixState

from . import ENGINE_TEST_0_5_15 as ENGINE_TEST, FIX_TEST, GUARD_TEST

GRAPHS_TEST = "tests/test_engine_versions.py::test_a_decode_graphs_on_0_5_15"
PORTS = {
    "capturer-extent": Port({ce.RECORD_EXTENT: "d51386f193d20925", ce.EXECUTED_EXTENT: "fd77ad70640d5781"},
                            test=FIX_TEST),
    "routed-experts-rows": Port({rer.GROW_GLOBAL_ARGS: "5146728cf1943c61"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "62a6ec3709f7bc5f"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "3ec4976a5007386c"}, test=FIX_TEST),
    "capture-snapshot": Port({snap.SNAPSHOT: "fd77ad70640d5781"}, test=FIX_TEST),
    "dp-buffer-sizing": Port(state=FixState.NOT_NEEDED, test=GUARD_TEST, reason=(
        "no dp_slot_in: one-entry per-rank lists are indexed by DP rank (IndexError), but no supported "
        "configuration reads one: with moe_a2a_backend none the MLP TP gather keeps full lists; with deepep + "
        "moe_dense_tp 1 + dp-lm-head every layer stays scattered, the logits DP gather is off and the capturer "
        "takes its deepep slice")),
    "verify-logits-truncation": Port(state=FixState.UPSTREAM, test=GUARD_TEST,
                                     reason="post_forward_mlp_sync_batch truncates padded verify logits"),
    "heartbeat-reset": Port(state=FixState.UPSTREAM, test=GUARD_TEST,
                            reason="/health_generate needs a message newer than the probe"),
    "prefill-graph-buckets": Port(state=FixState.NOT_NEEDED, test=ug.PREFILL_GRAPH_TEST, reason=(
        "prefill CUDA graphs are not on by default under DP attention; buckets are captured as given, so one "
        "requested explicitly there with attn_tp > 1 needs multiples of attn_tp_size")),
    "padding-rows-capture": same_as("v0_5_23"),
    "draft-token-count": Port({dtc.COUNT: "581aee9d31bda994"}, test=FIX_TEST),  # slime's patches leave it alone
    "accepted-path-rows": same_as("v0_5_23"),
    "retraction-rows": Port({rr.KEEP_REQ_IDX: "bd3c33a693d14000", rr.SPLICE: "d5129896884dfd79",
                             rr.STATE: "a1fba558fef5e717"}),  # slime's patches leave all three alone
    "retraction-routes": Port({rro.PLAN: "7467af5eea027cfe", rro.FORCE: "d35e7c95c6f53c68",
                               rro.OWN_PREFIX: "bd3c33a693d14000"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "6971b23c569722f0",
                                 wup.FLUSH_PAUSED: "df78e1c0280fd296"}),
    "tokenizer-workers": Port({tw.LOAD: "5885ee07efea2af2"}),
    # CPU family (0.5.15's BaseHostCache pins its own buffer: a second hook)
    "cpu-host-register": Port({hr.SKIP_REGISTER: "408f1eed3b00a7e6", hr.UNPINNED_HOST_CACHE: "24c16491a52570c3"},
                              test=ENGINE_TEST),
    "cpu-cuda-synchronize": same_as("v0_5_23"),
    "cpu-eagle-attn-backend": Port({eab.KEEP_AMX: "984563e2d6265ce6"}, test=ENGINE_TEST),
    "cpu-torch-native-fill": same_as("v0_5_23"),
    "cpu-ep-native-moe": Port({epm.LOCAL_IDS: "4fd0e5b793d2d0ac"}, test=ENGINE_TEST),
    "cpu-gloo-scatter-gather": Port({gvc.REDUCE_SCATTERV_CPU: "05109e16dab0bdb4", gvc.ALL_GATHERV_CPU: "9d85ae1727638521"},
                                    test=ENGINE_TEST),
    "cpu-gloo-stacked-allgather": Port({gsa.FLAT_OUTPUT: "bdef29a7aa66691f"}, test=ENGINE_TEST),
    "cpu-thread-binding": Port(state=FixState.NOT_NEEDED, test=ENGINE_TEST, reason=(
        "binds in ModelRunner.init_threads_binding, no numa_utils hook point; the engine launcher sets "
        "SGLANG_CPU_OMP_THREADS_BIND for multi-rank CPU engines")),
    "cpu-dp-controller-idle": Port(state=FixState.NOT_NEEDED, test=(
        "tests/test_cpu_fixes.py::test_dp_controller_idle_unreachable_on_older_variants"), reason=(
        "the busy-poll is there (event_loop bc008a8481258e79), but this SGLang spawns its DP controller "
        "process without load_plugins(), so no plugin hook reaches it")),
    # CPU graph replay
    "cpu-graphs-config": Port({gc.KEEP_GRAPH_BACKENDS: "bccb9d7e2d076d98"}, test=GRAPHS_TEST),
    "cpu-graphs-decode-runner": Port({dr.BUILD_AFTER_INIT: "b98042fb95cb3d06", dr.GRAPH_MODES: "c7880625d0ba90ef"},
                                     test=GRAPHS_TEST),
    "cpu-graphs-replay-backend": Port({rb.DECODE_BACKEND: "4760dab0325b3182", rb.PREFILL_BACKEND: "2eda1c652045b121",
                                       rb.DEVICE_MODULE: "80be75ebded8c4b9"}, test=GRAPHS_TEST),
    "cpu-graphs-attn-backend": same_as("v0_5_23"),
    "cpu-graphs-pynccl-state": same_as("v0_5_23"),
    "cpu-graphs-dp-memcpy": Port({dpm.TORCH_COPY: "d6398dd2bae4e16d"}),
    "cpu-graphs-mlp-sync-pin": Port({msp.NO_PIN: "3ec4976a5007386c"}),  # the same target as verify-padding-lcm
    # opt-in feature
    "compact-routed-experts": Port({w.COMPACT: "d5129896884dfd79", w.SPLIT: "a1fba558fef5e717",
                                    w.ADVERTISE: "88e5d21b6395d8e9"}),
}
