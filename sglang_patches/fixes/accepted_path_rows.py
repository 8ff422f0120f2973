"""Routed-expert rows of an EAGLE tree (top-k > 1) follow the tree, not the accepted path (sglang#37949).

Defect: a verify forward captures one row per tree token and the host copy writes it to that token's
KV slot. For top-k > 1 (and ngram) SGLang then moves the accepted path's KV to the front of the
request's window (`move_accept_tokens_to_target_kvcache`) but not the capture rows, so `get_topk`
returns the rows of the first tree nodes, some from a rejected branch: silently wrong R3. Top-k 1
(a chain) accepts a prefix, already in front. In every reviewed release.

Not needed: no supported configuration reaches it. Every shipped config and engine preset with
routed experts drafts top-k 1, and `config check` refuses top-k > 1 with routed experts.
"""
from sglang_patches.registry import Fix, Port
from sglang_patches.states import FixState

TEST = "tests/test_next_defects_sglang.py::test_accepted_path_rows_not_reached"
NOT_REACHED = Port(state=FixState.NOT_NEEDED, test=TEST, reason=(
    "top-k > 1 captures tree rows that the accepted-path KV move leaves behind, but no supported config "
    "reaches it: routed experts with speculative decoding use eagle_topk 1, and config check refuses "
    "top-k > 1 with routed experts"))

FIX = Fix(
    name="accepted-path-rows",
    family="dp-attention",
    defect="sglang#37949: with EAGLE top-k > 1 (or ngram) routed-expert rows stay at the tree's KV slots while the "
           "accepted path's KV moves to the front: a sample's rows come from a rejected branch.",
    reference="sglang#37949 (open)",
    test=TEST,
)
