"""DP-attention padding of speculative batches keeps whole requests: align to lcm(attn_tp, width).

Defect: `ForwardBatch.prepare_mlp_sync_batch` pads every DP rank's token count to a multiple
of attn_tp_size and then derives `bs = num_tokens // spec_info.num_tokens_per_req` (0.5.23
forward_batch_info.py:1871, :1936-1938). When that width (k = 3, 5, 6, ... for verify and draft
extend) neither divides nor is a multiple of attn_tp_size (2, 4, 8), the padded rows are not a
whole number of requests: attention is planned for `bs * k` rows but gets more.

Fix: a BEFORE hook aligns the gathered per-rank counts to lcm(attn_tp_size, width), where width
is the batch's own `spec_info.num_tokens_per_req`, the divisor above (SGLang's attn_tp
alignment is then a no-op). Why this is the same on every DP rank (0.5.23):
- the list SGLang pads is the gathered counts times this same local width
  (forward_batch_info.py:924-943, spec_info.py:465-479), so SGLang's own list agrees across
  ranks only where the width does;
- every rank sets it per phase, idle ranks included: draft decode = topk
  (eagle_worker_common.py:350, outside the idle branch), verify = k (eagle_info.py:47-48, idle
  input :65-88), draft extend = k (eagle_worker_v2.py:1156), draft extend after prefill = 1
  (:1012); target prefill has no spec_info. The local forward mode (IDLE vs TARGET_VERIFY) is
  never read.
- DP spec/prefill coordination (SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION, off by default)
  writes token counts itself and mixes widths in one step; its flag is set on every rank
  (dp_spec_prefill_coordination.py:50) and the hook leaves those steps to SGLang.
The padded bs = ceil_align(n, attn_tp / gcd(attn_tp, width)) stays within the eager registry's
ceil_align(max_running_requests, attn_tp) rows (eager_runner.py:111-121, common.py:4188-4195).
0.5.15.post1 and 0.5.16 derive bs the same way (forward_batch_info.py:1213/1257; :1276/1339) and
set the draft-decode width on every rank (base_spec_worker.py:258; eagle_worker_common.py:295),
so their ports register this same hook.
Aligning every speculative batch to the server-wide k instead, draft decode (width 1)
included, crashes: 4 requests padded to 6 rows, more than that registry holds (`The size of tensor a (4)
must match the size of tensor b (6)` in fill_from, configuration (c), 8 running requests).

Found while reading sglang#26016's second change against 0.5.23.
"""
import math

from sglang_patches.registry import Fix, Hook

from ._args import server_flag

TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch"


def alignment(attn_tp_size: int, width) -> int:
    """Token alignment the padded per-rank counts need (attn_tp_size when the width is harmless)."""
    w = width or 1
    if attn_tp_size <= 1 or w <= 1 or w % attn_tp_size == 0:
        return attn_tp_size
    return math.lcm(attn_tp_size, w)


def request_width(forward_batch):
    """Tokens per request SGLang divides this batch's padded count by (None: not a spec batch)."""
    if forward_batch.spec_info is None or getattr(forward_batch, "dp_spec_prefill_coordination_applied", False):
        return None
    return getattr(forward_batch.spec_info, "num_tokens_per_req", None)


def pad_counts(forward_batch, attn_tp_size: int) -> None:
    """Align the gathered per-rank token counts to whole requests (no-op when the width is harmless)."""
    align = alignment(attn_tp_size, request_width(forward_batch))
    if align != attn_tp_size and forward_batch.global_num_tokens_cpu is not None:
        forward_batch.global_num_tokens_cpu = [-(-n // align) * align for n in forward_batch.global_num_tokens_cpu]


def align_to_whole_requests(self, *args, **kwargs):
    """BEFORE ForwardBatch.prepare_mlp_sync_batch (0.5.15.post1, 0.5.16 and 0.5.23 alike)."""
    from sglang.srt.model_executor import forward_batch_info as fbi

    pad_counts(self, fbi.get_parallel().attn_tp_size)
    return None


ALIGN = Hook(TARGET, align_to_whole_requests, "before")


def needed(server_args: dict) -> bool:
    tp = server_flag(server_args, "tp_size", 1)
    dp = server_flag(server_args, "dp_size", 1)
    if not (server_flag(server_args, "enable_dp_attention", False) and server_flag(server_args, "speculative_algorithm")):
        return False
    attn_tp = max(1, tp // max(1, dp))
    widths = (server_flag(server_args, "speculative_num_draft_tokens", 1),   # verify, draft extend
              server_flag(server_args, "speculative_eagle_topk", 1))          # draft decode
    return any(alignment(attn_tp, w) != attn_tp for w in widths)


FIX = Fix(
    name="verify-padding-lcm",
    family="dp-attention",
    defect=(
        "DP-attention padding aligns speculative batches to attn_tp_size only, so a per-request width "
        "(draft tokens) that neither divides nor is a multiple of it leaves a partial request of padding "
        "rows. Verify and draft-extend attention then see more rows than they planned and crash."
    ),
    reference="found reading sglang#26016 against 0.5.23",
    test="tests/test_dp_fixes.py::test_verify_padding_lcm",
    needed=needed,
)
