"""CPU graph replay: SGLang's own CUDA-graph runners executed on CPU (opt-in).

A CPU engine normally runs eagerly (`CPUGraphRunner` refuses DP attention and speculative
decoding), so the runners' data flow (bucket choice, padding, `fill_from`, capturer extents,
verify / prefill replays) never runs on CPU. With `SLIME_MOE_ROLLOUT_CPU_GRAPHS=1` on a CPU engine
these fixes build SGLang's `DecodeCudaGraphRunner` / `PrefillCudaGraphRunner` and give them an
eager-replay backend (`backend.EagerReplayBackend`): capture records the forward callable and
its output, replay re-runs it on the runner's static, padded buffers.
Pick the buckets with SGLang's own flag, e.g.
`--cuda-graph-config '{"decode":{"backend":"full","bs":[1,2,4]},"prefill":{"backend":"full","bs":[16,32]}}'`.

Ported to 0.5.15.post1 and 0.5.19 besides 0.5.23 (`sglang_patches/ports/`): the same runner/backend split,
so the same backend fits; on 0.5.15.post1 the runner is chosen in `ModelRunner.init_decode_cuda_graph` and
torch_native turns graphs off in `ServerArgs._handle_attention_backend_compatibility` (their own hooks).
"""
import importlib
import os

ENV = "SLIME_MOE_ROLLOUT_CPU_GRAPHS"
GRAPH_FIX_MODULES = (
    "graph_config",
    "decode_runner",
    "replay_backend",
    "attn_graph_hooks",
    "pynccl_state",
    "dp_memcpy",
    "mlp_sync_pin",
)


def graphs_idle_reason():
    """None when graph replay was asked for on a CPU engine, else why these fixes stay idle."""
    from sglang_patches.cpu.fixes import cpu_idle_reason

    if os.environ.get(ENV) != "1":
        return f"applies only with {ENV}=1"
    return cpu_idle_reason()


def graphs_on() -> bool:
    return graphs_idle_reason() is None


FIXES = [importlib.import_module(f"{__name__}.{m}").FIX for m in GRAPH_FIX_MODULES]
