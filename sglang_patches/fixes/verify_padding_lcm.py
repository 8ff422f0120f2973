"""DP-attention padding of speculative batches keeps whole requests: align to lcm(attn_tp, k).

Defect: `ForwardBatch.prepare_mlp_sync_batch` pads every DP rank's token count to a multiple
of attn_tp_size and then derives `bs = num_tokens // num_draft_tokens` for verify / draft
extend. When the draft-token count k neither divides nor is a multiple of attn_tp_size
(k = 3, 5, 6, ... with attn_tp 2, 4, 8), the padded rows are not a whole number of requests:
attention is planned for `bs * k` rows but gets more (flashinfer raises; others misread).

Fix: with speculative decoding on, a BEFORE hook aligns the gathered per-rank counts to
lcm(attn_tp_size, k) before SGLang pads them (SGLang's own attn_tp alignment is then a no-op).
It depends only on the gathered list and server-wide settings, so every DP rank computes the
same padded list.

Reference: fix map §H2 (found while reading seed 000's fix 2 against 0.5.23).
"""
import math

from sglang_patches.registry import Fix, Hook

from ._args import server_flag

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch"


def alignment(attn_tp_size: int, draft_tokens) -> int:
    """Token alignment the padded per-rank counts need (attn_tp_size when k is harmless)."""
    k = draft_tokens or 1
    if attn_tp_size <= 1 or k <= 1 or k % attn_tp_size == 0:
        return attn_tp_size
    return math.lcm(attn_tp_size, k)


def pad_counts(forward_batch, attn_tp_size: int, draft_tokens) -> None:
    """Align the gathered per-rank token counts to whole requests (no-op when k is harmless)."""
    align = alignment(attn_tp_size, draft_tokens)
    if align != attn_tp_size and forward_batch.global_num_tokens_cpu is not None:
        forward_batch.global_num_tokens_cpu = [-(-n // align) * align for n in forward_batch.global_num_tokens_cpu]


def align_to_whole_requests(self, *args, **kwargs):
    from sglang.srt.model_executor import forward_batch_info as fbi
    from sglang.srt.runtime_context import max_speculative_num_draft_tokens

    pad_counts(self, fbi.get_parallel().attn_tp_size, max_speculative_num_draft_tokens())
    return None


def needed(server_args: dict) -> bool:
    tp = server_flag(server_args, "tp_size", 1)
    dp = server_flag(server_args, "dp_size", 1)
    if not (server_flag(server_args, "enable_dp_attention", False) and server_flag(server_args, "speculative_algorithm")):
        return False
    attn_tp = max(1, tp // max(1, dp))
    return alignment(attn_tp, server_flag(server_args, "speculative_num_draft_tokens", 1)) != attn_tp


FIX = Fix(
    name="verify-padding-lcm",
    family="dp-attention",
    defect=(
        "DP-attention padding aligns speculative batches to attn_tp_size only, so a draft-token count "
        "that neither divides nor is a multiple of it leaves a partial request of padding rows. "
        "Verify and draft-extend attention then see more rows than they planned and crash."
    ),
    reference="fix map §H2 (seed 000 fix 2 context)",
    versions=("0.5.23",),
    test="tests/test_dp_fixes.py::test_verify_padding_lcm",
    hooks=(Hook(TARGET, align_to_whole_requests, "before"),),
    fingerprints={"0.5.23": {TARGET: "314a988fac1c4001"}},
    needed=needed,
)
