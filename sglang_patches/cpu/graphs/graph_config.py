"""CPU graphs: torch_native turns every graph phase off during server-argument resolution.

`handle_attention_backend_compatibility` declares decode and prefill graphs `disabled` whenever
the attention backend is torch_native (arg_groups/attention_hook.py, 0.5.23 :124-137), whatever
`--cuda-graph-config` asked for. Resolution happens once in the launcher, so every process
inherits it.

Fix: AROUND that pass: with CPU graph replay on, re-declare the graph config the pass found
(the user's buckets and backends) after it ran; everything else it decided stays.
0.5.15.post1 does the same in `ServerArgs._handle_attention_backend_compatibility` by writing
`cuda_graph_config.{decode,prefill}.backend` itself: an AROUND hook there puts the two backends back.
"""
from sglang_patches.registry import Fix, Hook

from . import graphs_idle_reason, graphs_on

TARGET = "sglang.srt.arg_groups.attention_hook.handle_attention_backend_compatibility"
SERVER_ARGS_TARGET = "sglang.srt.server_args.ServerArgs._handle_attention_backend_compatibility"  # 0.5.15.post1


def keep_graph_config(original, server_args, *args, **kwargs):
    if not graphs_on():
        return original(server_args, *args, **kwargs)
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    before = resolving_view(server_args).cuda_graph_config
    out = original(server_args, *args, **kwargs)
    view = resolving_view(server_args)
    if view.device == "cpu" and view.cuda_graph_config != before:
        declare_resolution(server_args, "slime_moe_rollout_cpu_graphs", cuda_graph_config=before)
    return out


def keep_graph_backends(original, self, *args, **kwargs):
    cfg = getattr(self, "cuda_graph_config", None)
    if not graphs_on() or self.device != "cpu" or cfg is None:
        return original(self, *args, **kwargs)
    before = (cfg.decode.backend, cfg.prefill.backend)
    out = original(self, *args, **kwargs)
    cfg = self.cuda_graph_config
    cfg.decode.backend, cfg.prefill.backend = before
    return out


KEEP_GRAPH_CONFIG = Hook(TARGET, keep_graph_config, "around")
KEEP_GRAPH_BACKENDS = Hook(SERVER_ARGS_TARGET, keep_graph_backends, "around")

FIX = Fix(
    name="cpu-graphs-config",
    family="cpu",
    defect=(
        "Server-argument resolution disables decode and prefill graphs whenever the attention backend is "
        "torch_native. A CPU engine can then never run SGLang's graph runners, whatever --cuda-graph-config says."
    ),
    reference="found running SGLang's graph runners on CPU",
    test="tests/test_cpu_graphs.py::test_graph_config_kept",
    when=graphs_idle_reason,
)
