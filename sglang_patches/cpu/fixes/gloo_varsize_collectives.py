"""CPU: `reduce_scatterv` / `all_gatherv` exist only for pynccl.

`GroupCoordinator.reduce_scatterv` and `all_gatherv` go straight to the pynccl communicator.
On CPU (gloo) it is not usable, so DP attention with `--enable-dp-lm-head` or EP
(layer_boundary `dp_reduce_scatterv`, the standard MoE dispatcher) crashes on its first forward.

Fix: AROUND both, only for CPU tensors: reduce_scatterv uses SGLang's own all_reduce + slice
path (`_deterministic_reduce_scatterv`); all_gatherv pads every rank's rows to the largest size,
runs `torch.distributed.all_gather` on the gloo device group and strips the padding.
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

PS = "sglang.srt.distributed.parallel_state.GroupCoordinator"
REDUCE_SCATTERV = PS + ".reduce_scatterv"
ALL_GATHERV = PS + ".all_gatherv"


def _on_cpu(t) -> bool:
    import torch

    ts = [t] if isinstance(t, torch.Tensor) else list(t)
    return bool(ts) and all(x.device.type == "cpu" for x in ts)


def reduce_scatterv_cpu(original, self, input_, output=None, sizes=None):
    if not _on_cpu(input_):
        return original(self, input_, output=output, sizes=sizes)
    return self._deterministic_reduce_scatterv(input_, output, sizes)


def gather_rows(group, world_size: int, rank: int, inp, sizes):
    """All ranks' rows of `inp` concatenated in rank order (sizes[r] rows from rank r)."""
    import torch
    import torch.distributed as dist

    sizes = list(sizes) if sizes is not None else [inp.shape[0]] * world_size
    if len(sizes) != world_size or inp.shape[0] != sizes[rank]:
        raise ValueError(f"all_gatherv: sizes {sizes} do not match world {world_size} / local rows {inp.shape[0]}")
    width = max(sizes) if sizes else 0
    padded = inp.new_zeros((width,) + tuple(inp.shape[1:]))
    padded[: inp.shape[0]] = inp
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


def all_gatherv_cpu(original, self, input_, sizes=None, output=None):
    if not _on_cpu(input_):
        return original(self, input_, sizes=sizes, output=output)
    import torch

    single = isinstance(input_, torch.Tensor)
    inputs = [input_] if single else list(input_)
    if output is not None and not single:
        raise ValueError("all_gatherv `output` requires a single-tensor input")
    results = []
    for inp in inputs:
        full = gather_rows(self.device_group, self.world_size, self.rank_in_group, inp, sizes)
        if output is not None:
            if tuple(output.shape) != tuple(full.shape):
                raise ValueError(f"all_gatherv output buffer shape {tuple(output.shape)} != expected {tuple(full.shape)}")
            output.copy_(full)
            full = output
        results.append(full)
    return results


REDUCE_SCATTERV_CPU = Hook(REDUCE_SCATTERV, reduce_scatterv_cpu, "around")
ALL_GATHERV_CPU = Hook(ALL_GATHERV, all_gatherv_cpu, "around")

FIX = Fix(
    name="cpu-gloo-scatter-gather",
    family="cpu",
    defect=(
        "GroupCoordinator.reduce_scatterv and all_gatherv only work through pynccl. On CPU (gloo) DP attention "
        "with dp-lm-head or EP crashes on the first forward."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-gloo-scatter-gather]",
    when=cpu_idle_reason,
)
