"""Defects SGLang handles itself (three changes proposed in sglang#26016, and sglang#36262's prefill-graph
buckets). Guard tests only, no hooks.

- dp-buffer-sizing (global_num_tokens sizing for require_attn_tp_gather): 0.5.21 and later keep
  one-entry lists on purpose and resolve them with `dp_slot_in`; porting the proposed change would
  make `set_local_num_token_non_padded` read rank 0's count on every rank. Older releases index
  the lists by DP rank, but no supported configuration reads a one-entry list there (not-needed).
- verify-logits-truncation (truncate padded verify logits): `post_forward_mlp_sync_batch` slices.
- heartbeat-reset (reset the heartbeat before "fired up"): `/health_generate` only accepts a message
  received after the probe's own start, so the reset changes nothing.
- prefill-graph-buckets (sglang#36262): under DP attention with attn_tp > 1 a prefill-graph bucket that is
  not a multiple of attn_tp_size stops the graph's DP gather; 0.5.22+ run prefill graphs there by default
  and align every bucket to attn_tp_size themselves; earlier releases do not run them there by default.
"""
from sglang_patches.registry import Fix

PREFILL_GRAPH_TEST = "tests/test_prefill_graph_attn_tp.py"   # a real CPU engine (e2e)

FIXES = [
    Fix(
        name="dp-buffer-sizing",
        family="dp-attention",
        defect="Per-rank token lists are sized by require_mlp_tp_gather only, so one-entry lists get indexed "
        "by DP rank. SGLang 0.5.21+ resolves one-entry lists via dp_slot_in; the proposed change would break it.",
        reference="sglang#26016",
        test="tests/test_upstream_guards.py::test_dp_buffer_sizing_guard",
    ),
    Fix(
        name="verify-logits-truncation",
        family="dp-attention",
        defect="Padded verify logits not truncated to the real requests. SGLang truncates them in "
        "post_forward_mlp_sync_batch and the decode graph runner.",
        reference="sglang#26016",
        test="tests/test_upstream_guards.py::test_verify_logits_truncation_guard",
    ),
    Fix(
        name="heartbeat-reset",
        family="dp-attention",
        defect="Reset last_receive_tstamp before 'fired up'. SGLang's /health_generate needs a message "
        "newer than the probe itself, so the reset is a no-op.",
        reference="sglang#26016",
        test="tests/test_upstream_guards.py::test_heartbeat_reset_guard",
    ),
    Fix(
        name="prefill-graph-buckets",
        family="dp-attention",
        defect="Prefill-graph buckets that are not multiples of attn_tp_size stop the graph's DP gather under DP "
        "attention with attn_tp > 1. 0.5.22+ capture every bucket aligned to attn_tp_size.",
        reference="sglang#36262",
        test=PREFILL_GRAPH_TEST,
    ),
]
