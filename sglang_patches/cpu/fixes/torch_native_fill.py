"""CPU: TorchNativeAttnBackend lacks `get_cpu_graph_seq_len_fill_value`.

Under DP attention, `ForwardBatch._pad_inputs_to_size` pads every rank's batch and asks the
attention backend for the sequence length of padded rows through
`get_cpu_graph_seq_len_fill_value()`. Only IntelAMXAttnBackend defines it (returning 1), so the
first forward with torch_native kills every rank with an AttributeError.

Fix: AFTER `TorchNativeAttnBackend.__init__`: give the instance that method when its class has
none, returning 1 like the intel_amx backend (a padded row attends to one token).
"""
from sglang_patches.registry import Fix, Hook

from . import cpu_idle_reason

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__"
FILL_VALUE = 1


def _fill_value():
    return FILL_VALUE


def add_fill_value(result, self, *args, **kwargs):
    if not hasattr(type(self), "get_cpu_graph_seq_len_fill_value"):
        self.get_cpu_graph_seq_len_fill_value = _fill_value
    return None


ADD_FILL = Hook(TARGET, add_fill_value, "after")

FIX = Fix(
    name="cpu-torch-native-fill",
    family="cpu",
    defect=(
        "TorchNativeAttnBackend has no get_cpu_graph_seq_len_fill_value, which batch padding calls on CPU. "
        "The first forward under DP attention with the torch_native backend crashes every rank."
    ),
    reference="found running SGLang on CPU (MoE, EAGLE, DP attention)",
    test="tests/test_cpu_fixes.py::test_fix_needed_and_effective[cpu-torch-native-fill]",
    when=cpu_idle_reason,
)
