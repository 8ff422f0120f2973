"""CPU graphs: DP attention's gather/scatter copies rows with a Triton kernel only (0.5.15.post1).

`dp_attention.memcpy_triton` (0.5.15.post1 :461) launches `memcpy_triton_kernel` whatever the device;
`_dp_gather_via_all_reduce` and `dp_scatter` call it to place a rank's rows in the DP-gathered buffer
and back. With no Triton driver on CPU, a DP-attention prefill-graph capture dies there
("0 active drivers"). From 0.5.19 on SGLang picks its own CPU copy (`memcpy_cpu`) on CPU.

Fix: AROUND `memcpy_triton`: for CPU tensors do the copy the kernel does with torch, `sz` rows
(offset and size are 1-element tensors, in rows of `src.shape[1:]`) from `src[offset:]` into `dst`
(`offset_src`) or from `src` into `dst[offset:]`, never past either tensor's rows.
"""
from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

TARGET = "sglang.srt.layers.dp_attention.memcpy_triton"


def copy_rows(dst, src, offset: int, sz: int, offset_src: bool) -> None:
    """The kernel's copy on CPU tensors (dim 0): `sz` rows at `offset` of src (offset_src) or of dst."""
    if offset_src:
        n = max(0, min(sz, src.shape[0] - offset, dst.shape[0]))
        dst[:n].copy_(src[offset:offset + n])
    else:
        n = max(0, min(sz, dst.shape[0] - offset, src.shape[0]))
        dst[offset:offset + n].copy_(src[:n])


def torch_copy_on_cpu(original, dst, src, dim, offset, sz, offset_src, *args, **kwargs):
    if graphs_on() and dst.device.type == "cpu" and src.device.type == "cpu":
        assert dim == 0 and src.shape[1:] == dst.shape[1:], "memcpy_triton: rows of the same shape only"
        copy_rows(dst, src, int(offset), int(sz), bool(offset_src))
        return None
    return original(dst, src, dim, offset, sz, offset_src, *args, **kwargs)


TORCH_COPY = Hook(TARGET, torch_copy_on_cpu, "around")

FIX = Fix(
    name="cpu-graphs-dp-memcpy",
    family="cpu",
    defect=(
        "DP attention's gather and scatter copy a rank's rows with a Triton kernel on every device. "
        "On CPU a DP-attention prefill-graph capture dies there with no Triton driver."
    ),
    reference="found capturing a DP-attention prefill graph on CPU (SGLang 0.5.15.post1)",
    test="tests/test_cpu_graphs.py::test_dp_memcpy_on_0_5_15",
    when=graphs_idle_reason,
)
