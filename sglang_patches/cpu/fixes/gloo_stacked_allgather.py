"""CPU: all_gather_into_tensor into a stacked (world, ...) output fails on gloo.

With DP attention and attn_tp > 1 plus `--enable-dp-lm-head`, the logits processor
(`_gather_attn_tp_logits`) gathers each rank's vocab shard into an output shaped
(attn_tp, tokens, shard) via `all_gather_into_tensor`. NCCL only looks at the byte count,
but gloo's `all_gather_into_tensor` requires the output to be (world * tokens, shard) and
raises "ProcessGroupGloo::allgather: invalid tensor size" on the first decode.

Fix: AROUND `GroupCoordinator.all_gather_into_tensor`: for CPU tensors whose output is the
stacked form (world, *input.shape), pass a (world * rows, ...) view of the same memory.
Found by running configuration (c) (tp 4, dp 2, attn_tp 2, dp-lm-head) on CPU.
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator.all_gather_into_tensor"


def flat_output(original, self, output, input, *args, **kwargs):
    if (
        output.device.type == "cpu"
        and output.dim() == input.dim() + 1
        and output.shape[0] == self.world_size
        and tuple(output.shape[1:]) == tuple(input.shape)
        and output.is_contiguous()
    ):
        output = output.view((self.world_size * input.shape[0],) + tuple(input.shape[1:]))
    return original(self, output, input, *args, **kwargs)


FLAT_OUTPUT = Hook(TARGET, flat_output, "around")

FIX = Fix(
    name="cpu-gloo-stacked-allgather",
    family="cpu",
    defect=(
        "The attn-TP logits gather (dp-lm-head, attn_tp > 1) all-gathers into a stacked (world, tokens, shard) "
        "output, which gloo rejects. DP attention with attn_tp 2 on CPU crashes on its first decode."
    ),
    reference="found running configuration (c) on CPU (logits_processor._gather_attn_tp_logits)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-gloo-stacked-allgather]",
    when=cpu_idle_reason,
)
