"""CPU graphs: the CPU attention backends lack the graph-runner hooks.

`torch_native` and `intel_amx` implement only eager `init_forward_metadata`; the graph runner
calls `init_cuda_graph_state`, `get_cuda_graph_seq_len_fill_value` (base_attn_backend.py,
0.5.23 :256, :286, both raise NotImplementedError) and prepares each capture / replay through
`init_forward_metadata_out_graph` (a no-op by default, so replays would attend with stale
metadata).

Fix: AROUND those three base methods, for these two backends only: no graph state to allocate;
padded rows get sequence length 1 (what intel_amx's own CPU-graph hook returns); and the
out-of-graph prep runs the backend's eager `init_forward_metadata` on the runner's batch view
(capture batch or replay view), the only metadata prep these backends have.
"""
from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

BASE = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
STATE = f"{BASE}.init_cuda_graph_state"
FILL = f"{BASE}.get_cuda_graph_seq_len_fill_value"
OUT_GRAPH = f"{BASE}.init_forward_metadata_out_graph"
CPU_BACKENDS = ("TorchNativeAttnBackend", "IntelAMXAttnBackend", "IntelAMXMultiStepDraftBackend")
SEQ_LEN_FILL = 1


def _cpu_backend(self) -> bool:
    return graphs_on() and any(c.__name__ in CPU_BACKENDS for c in type(self).__mro__)


def no_graph_state(original, self, *args, **kwargs):
    if _cpu_backend(self):
        return None
    return original(self, *args, **kwargs)


def seq_len_fill(original, self, *args, **kwargs):
    if _cpu_backend(self):
        return SEQ_LEN_FILL
    return original(self, *args, **kwargs)


def eager_metadata(original, self, forward_batch, *args, **kwargs):
    if _cpu_backend(self):
        return self.init_forward_metadata(forward_batch)
    return original(self, forward_batch, *args, **kwargs)


NO_STATE = Hook(STATE, no_graph_state, "around")
FILL_HOOK = Hook(FILL, seq_len_fill, "around")
EAGER_METADATA = Hook(OUT_GRAPH, eager_metadata, "around")

FIX = Fix(
    name="cpu-graphs-attn-backend",
    family="cpu",
    defect=(
        "The CPU attention backends (torch_native, intel_amx) implement none of the graph-runner hooks: "
        "init_cuda_graph_state and get_cuda_graph_seq_len_fill_value raise, and replays would keep stale metadata."
    ),
    reference="found running SGLang's graph runners on CPU",
    test="tests/test_cpu_graphs.py::test_decode_graph_one_rank_equals_eager",
    when=graphs_idle_reason,
)
