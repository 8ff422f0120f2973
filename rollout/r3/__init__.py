"""Routing replay (R3): what it buys. Rollout-vs-trainer logprob mismatch with and without replay.

- ``metrics``: k3 KL, mean |d|, extreme fractions, routing flip rates (one table row per arm).
- ``replay``: transformers' GLM-4.5 forward with its own routing or the captured one replayed.
- ``check``: roll prompts out through the manager, recompute both arms, the table and its verdict.
"""
