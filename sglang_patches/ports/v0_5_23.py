"""SGLang 0.5.23 (PyPI wheel): the table every other one follows in order; all its entries are its own.

compact-routed-experts (an opt-in feature) hooks the scheduler's `_maybe_collect_routed_experts`, the
tokenizer manager's `_wait_one_response` and `get_internal_state`; the detokenizer's
`_b64_encode_per_request` (identical in every reviewed release) encodes any tensor's bytes: no hook.
"""
from sglang_patches.cpu.fixes import (cuda_synchronize as cs, dp_controller_idle as dci, eagle_attention_backend as eab,
                                      ep_native_moe as epm, gloo_stacked_allgather as gsa,
                                      gloo_varsize_collectives as gvc, host_register as hr, thread_binding as tb,
                                      torch_native_fill as tnf)
from sglang_patches.cpu.graphs import (attn_graph_hooks as agh, decode_runner as dr, graph_config as gc,
                                       pynccl_state as ps, replay_backend as rb)
from sglang_patches.features import routed_experts_wire as w
from sglang_patches.fixes import (accepted_path_rows as apr, capturer_extent as ce, draft_extend_real_rows as de,
                                  routed_experts_rows as rer, verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.fixes import retraction_routes as rro
from sglang_patches.fixes import upstream_guards as ug
from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.fixes import tokenizer_workers as tw
from sglang_patches.registry import Port
from sglang_patches.states import FixState

GUARDS = "tests/test_upstream_guards.py"
PORTS = {
    "capturer-extent": Port({ce.RECORD_EXTENT: "c217bd61336be489", ce.EXECUTED_EXTENT: "e289e633c1082b48"}),
    "routed-experts-rows": Port({rer.GROW: "40d769cb2c2c22a1"}),
    "draft-extend-real-rows": Port({de.REAL_ROWS: "94fe1a9b9b47a845"}),
    "verify-padding-lcm": Port({vpl.ALIGN: "314a988fac1c4001"}),
    "capture-snapshot": Port(state=FixState.UPSTREAM, test="tests/test_dp_fixes.py::test_unaffected_paths_stay_correct",
                             reason="on_forward_end clones out_cache_loc and the top-k slice (sglang#34319)"),
    "dp-buffer-sizing": Port(state=FixState.UPSTREAM, test=f"{GUARDS}::test_dp_buffer_sizing_guard",
                             reason="one-entry per-rank lists are resolved via dp_slot_in"),
    "verify-logits-truncation": Port(state=FixState.UPSTREAM, test=f"{GUARDS}::test_verify_logits_truncation_guard",
                                     reason="post_forward_mlp_sync_batch truncates padded verify logits"),
    "heartbeat-reset": Port(state=FixState.UPSTREAM, test=f"{GUARDS}::test_heartbeat_reset_guard",
                            reason="/health_generate needs a message newer than the probe"),
    "prefill-graph-buckets": Port(state=FixState.UPSTREAM, test=ug.PREFILL_GRAPH_TEST, reason=(
        "PrefillCudaGraphRunner captures get_prefill_num_tokens_to_capture: every bucket aligned to attn_tp_size "
        "when the gathered buffer is required (always under DP attention with moe_a2a_backend none)")),
    "padding-rows-capture": Port(state=FixState.NOT_NEEDED, reason=(
        "captured before the padded-region mask, but padded rows are stored to the reserved KV slot 0, which no "
        "request's req_to_token holds")),
    "draft-token-count": Port(state=FixState.UPSTREAM, test="tests/test_dp_fixes.py::test_unaffected_paths_stay_correct",
                              reason="_init_num_token_non_padded counts batch_size x num_tokens_per_req for a draft "
                                     "worker's decode batch"),
    "accepted-path-rows": Port(state=FixState.NOT_NEEDED, test=apr.TEST, reason=(
        "top-k > 1 captures tree rows that the accepted-path KV move leaves behind, but no supported config "
        "reaches it: routed experts with speculative decoding use eagle_topk 1; config check and the engine "
        "(routed-experts-rows' capturer hook) refuse top-k > 1 with routed experts")),
    "retraction-rows": Port({rr.KEEP: "e9a690b5c7084bb5", rr.SPLICE: "0a42f229acf94e72", rr.STATE: "153426e70898ed8b"}),
    "retraction-routes": Port({rro.PLAN: "4e9bb4d5e649e2f1", rro.FORCE: "4402979b49f0f123",
                               rro.OWN_PREFIX: "e9a690b5c7084bb5"}),
    "weight-update-pause": Port({wup.RETRACT_PAUSE: "f614eaca4d104fd0", wup.KEEP_ON_VERSION: "f4822939e280a0aa"}),
    "tokenizer-workers": Port({tw.LOAD: "7b68d6a8a80953ba"}),
    # CPU family
    "cpu-host-register": Port({hr.SKIP_REGISTER: "f13fb8ab7ebf962a"}),
    "cpu-cuda-synchronize": Port({cs.NO_SYNC: "3438d8ef569c0d5f"}),
    "cpu-eagle-attn-backend": Port({eab.KEEP_AMX: "3079ae037f4ed53b"}),
    "cpu-torch-native-fill": Port({tnf.ADD_FILL: "681e6d1c8d8ac744"}),
    "cpu-ep-native-moe": Port({epm.LOCAL_IDS: "53b7e13072dbf344"}),
    "cpu-gloo-scatter-gather": Port({gvc.REDUCE_SCATTERV_CPU: "a26ecd35d9794ff2", gvc.ALL_GATHERV_CPU: "b78c06194cca196a"}),
    "cpu-gloo-stacked-allgather": Port({gsa.FLAT_OUTPUT: "6c3b3198a56c4901"}),
    "cpu-thread-binding": Port({tb.BIND: "907397afc037cbed"}),
    "cpu-dp-controller-idle": Port({dci.SLEEP_WHEN_IDLE: "bc008a8481258e79"}),  # as on 0.5.15.post1 and 0.5.16
    # CPU graph replay (ported to 0.5.15.post1 and 0.5.19 too; elsewhere idle unless asked for, then refused)
    "cpu-graphs-config": Port({gc.KEEP_GRAPH_CONFIG: "cadd45a5529970fa"}),
    "cpu-graphs-decode-runner": Port({dr.BUILD_DECODE_RUNNER: "98b24a36e0212367", dr.GRAPH_MODES: "c7880625d0ba90ef"}),
    "cpu-graphs-replay-backend": Port({rb.DECODE_BACKEND: "29a030e3c164d133", rb.PREFILL_BACKEND: "bd53dc563d9a5033",
                                       rb.DEVICE_MODULE: "efbd44b158aa651b"}),
    "cpu-graphs-attn-backend": Port({agh.NO_STATE: "bf6580225eeb7cc7", agh.FILL_HOOK: "f7efe5e1ce080f78",
                                     agh.EAGER_METADATA: "3cc5c7014b95a738"}),
    "cpu-graphs-pynccl-state": Port({ps.KEEP_OFF: "c6b3a7c9e2c18d9e"}),
    "cpu-graphs-dp-memcpy": Port(state=FixState.UPSTREAM, test="tests/test_cpu_graphs.py::test_dp_memcpy_on_0_5_15",
                                 reason="dp_attention.memcpy copies with torch (memcpy_cpu) on CPU"),
    "cpu-graphs-mlp-sync-pin": Port(state=FixState.UPSTREAM,
                                    test="tests/test_engine_versions.py::test_c_routed_experts_match_transformers",
                                    reason="prepare_mlp_sync_batch pins only where pinned memory is available"),
    # opt-in feature
    "compact-routed-experts": Port({w.COMPACT: "0a42f229acf94e72", w.SPLIT: "153426e70898ed8b",
                                    w.ADVERTISE: "2c8c8a78ff656d01"}),
}
