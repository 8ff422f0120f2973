"""Three changes proposed in sglang#26016 that SGLang handles itself. Guard tests only, no hooks.

- dp-buffer-sizing (global_num_tokens sizing for require_attn_tp_gather): 0.5.21 and later keep
  one-entry lists on purpose and resolve them with `dp_slot_in`; porting the proposed change would
  make `set_local_num_token_non_padded` read rank 0's count on every rank. Older releases index
  the lists by DP rank, but no supported configuration reads a one-entry list there (not-needed).
- verify-logits-truncation (truncate padded verify logits): `post_forward_mlp_sync_batch` slices.
- heartbeat-reset (reset the heartbeat before "fired up"): `/health_generate` only accepts a message
  received after the probe's own start, so the reset changes nothing.
"""
from sglang_patches.registry import Fix

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
]
