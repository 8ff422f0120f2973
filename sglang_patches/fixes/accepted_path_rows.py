"""Routed-expert rows of an EAGLE tree (top-k > 1) follow the tree, not the accepted path (sglang#37949).

Defect: a verify forward captures one row per tree token and the host copy writes it to that token's
KV slot. For top-k > 1 (and ngram) SGLang then moves the accepted path's KV to the front of the
request's window (`move_accept_tokens_to_target_kvcache`) but not the capture rows, so `get_topk`
returns the rows of the first tree nodes, some from a rejected branch: silently wrong R3. Top-k 1
(a chain) accepts a prefix, already in front. In every reviewed release.

Not needed: no supported configuration reaches it. Every shipped config and engine preset with
routed experts drafts top-k 1, `config check` refuses top-k > 1 (or ngram) with routed experts however
the flags are given, and inside the engine `refuse_tree_capture` (called by routed-experts-rows' hook on
`RoutedExpertsCapturer.__init__`, on every reviewed release) stops the capturer with one log line.
"""
import logging

from sglang_patches.registry import Fix

TEST = "tests/test_next_defects_sglang.py::test_accepted_path_rows_not_reached"
REFUSAL = ("slime-moe-rollout: routed-expert capture refused: speculative {what} moves the accepted path's KV but "
           "not its routed-expert rows (sglang#37949); use EAGLE with speculative_eagle_topk 1")
logger = logging.getLogger("slime_moe_rollout")


def tree_drafts(algorithm, topk) -> bool:
    """Does this speculative setting draft a tree (top-k > 1) or ngram, whose accepted path SGLang moves?"""
    name = str(getattr(algorithm, "name", algorithm) or "").upper()
    return bool(name) and name != "NONE" and (name == "NGRAM" or int(topk or 1) > 1)


def refuse_tree_capture(algorithm, topk) -> None:
    """In the engine, before SGLang builds the routed-experts capturer: one log line and a ValueError when the
    speculative setting drafts a tree; nothing otherwise."""
    if tree_drafts(algorithm, topk):
        name = str(getattr(algorithm, "name", algorithm)).upper()
        msg = REFUSAL.format(what="ngram" if name == "NGRAM" else f"{name} top-k {topk}")
        logger.error(msg)
        raise ValueError(msg)

FIX = Fix(
    name="accepted-path-rows",
    family="dp-attention",
    defect="sglang#37949: with EAGLE top-k > 1 (or ngram) routed-expert rows stay at the tree's KV slots while the "
           "accepted path's KV moves to the front: a sample's rows come from a rejected branch.",
    reference="sglang#37949 (open)",
    test=TEST,
)
