"""Seed-000 fixes 1, 3 and 4: already handled by SGLang 0.5.23. Guard tests only, no hooks.

- Fix 1 (global_num_tokens sizing for require_attn_tp_gather): 0.5.23 keeps one-entry lists
  on purpose and resolves them with `dp_slot_in`; porting the seed's change would make
  `set_local_num_token_non_padded` read rank 0's count on every rank.
- Fix 3 (truncate padded verify logits): `post_forward_mlp_sync_batch` already slices.
- Fix 4 (heartbeat reset before "fired up"): `/health_generate` only accepts a message received
  after the probe's own start, so the reset changes nothing.
"""
from sglang_patches.registry import Fix, Port

FIXES = [
    Fix(
        name="dp-buffer-sizing",
        family="dp-attention",
        defect="Seed 000 fix 1: per-rank token lists sized by require_mlp_tp_gather only. SGLang 0.5.23 "
        "resolves one-entry lists via dp_slot_in; porting the seed change would break it.",
        reference="seed 000 fix 1 (sglang#26016); fix map §A",
        test="tests/test_upstream_guards.py::test_dp_buffer_sizing_guard",
        ports={"0.5.23": Port(state="upstream", reason="SGLang 0.5.23 resolves one-entry lists via dp_slot_in")},
    ),
    Fix(
        name="verify-logits-truncation",
        family="dp-attention",
        defect="Seed 000 fix 3: padded verify logits not truncated. SGLang 0.5.23 truncates in "
        "post_forward_mlp_sync_batch and the decode graph runner.",
        reference="seed 000 fix 3 (sglang#26016); fix map §C",
        test="tests/test_upstream_guards.py::test_verify_logits_truncation_guard",
        ports={"0.5.23": Port(state="upstream", reason="SGLang 0.5.23 truncates in post_forward_mlp_sync_batch")},
    ),
    Fix(
        name="heartbeat-reset",
        family="dp-attention",
        defect="Seed 000 fix 4: reset last_receive_tstamp before 'fired up'. In SGLang 0.5.23 "
        "/health_generate needs a message newer than the probe itself, so the reset is a no-op.",
        reference="seed 000 fix 4 (sglang#26016); fix map §D",
        test="tests/test_upstream_guards.py::test_heartbeat_reset_guard",
        ports={"0.5.23": Port(state="upstream", reason="SGLang 0.5.23's /health_generate needs a newer message")},
    ),
]
