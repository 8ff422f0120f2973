"""CPU graph replay (`sglang_patches/cpu/graphs`): SGLang's own graph runners on a CPU engine.

Fast checks: the backend's capture/replay contract, and each hooked SGLang function called in a
probe subprocess with and without the plugin (stock SGLang shows the CPU gap, the plugin closes
it). Slow checks start real engines with `SLIME_MOE_ROLLOUT_CPU_GRAPHS=1` and compare with the
same engine in eager mode (tokens, logprobs, routed experts) and with transformers.
"""
import json
import os
import subprocess
import sys

import pytest

from sglang_patches.cpu.graphs import ENV, FIXES
from sglang_patches.cpu.graphs.backend import copy_into, make_backend
from sglang_patches.registry import judge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r'''
import json, sys, types
from sglang.srt.plugins import load_plugins
load_plugins()
results = {}

def check(name):
    def deco(fn):
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return fn
    return deco

@check("graph-config")
def _():
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.arg_groups.overrides import resolved_view
    sa = prepare_server_args(["--model-path", sys.argv[1], "--device", "cpu", "--attention-backend", "torch_native",
                              "--cuda-graph-config", '{"decode":{"backend":"full","bs":[1,2]},"prefill":{"backend":"full","bs":[16]}}'])
    sa.resolve_once()
    cfg = resolved_view(sa).cuda_graph_config
    return [cfg.decode.backend, cfg.prefill.backend]

@check("verify-dispatch")
def _():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    return [m.name for m in ForwardMode if m.is_cpu_graph()]

@check("attn-fill")
def _():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    b = TorchNativeAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None))
    b.init_cuda_graph_state(4, 4)
    return b.get_cuda_graph_seq_len_fill_value()

@check("pynccl-state")
def _():
    from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator
    comm = object.__new__(PyNcclCommunicator)
    comm.available, comm.disabled = False, True
    with comm.change_state(enable=True):
        return "disabled" if comm.disabled else "enabled"

print("PROBE-RESULTS " + json.dumps(results))
'''


def run_probe(model, **env_over) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", **{ENV: "1"})
    for k in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE"):
        env.pop(k, None)
    env.update(env_over)
    proc = subprocess.run([sys.executable, "-c", PROBE, model], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=400)
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULTS "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"probe failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def probes(tiny_match_model):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        stock = ex.submit(run_probe, tiny_match_model, SGLANG_PLUGINS="none")
        fixed = ex.submit(run_probe, tiny_match_model)
        return {"stock": stock.result(), "fixed": fixed.result()}


@pytest.mark.timeout(600)
def test_graph_config_kept(probes):
    assert probes["stock"]["graph-config"] == ["disabled", "disabled"]
    assert probes["fixed"]["graph-config"] == ["full", "full"]


@pytest.mark.timeout(600)
def test_verify_and_idle_batches_reach_the_graph_runner(probes):
    assert probes["stock"]["verify-dispatch"] == ["DECODE"]
    assert set(probes["fixed"]["verify-dispatch"]) >= {"DECODE", "TARGET_VERIFY", "IDLE"}


@pytest.mark.timeout(600)
def test_cpu_attention_backends_get_graph_hooks(probes):
    assert probes["stock"]["attn-fill"].startswith("NotImplementedError")
    assert probes["fixed"]["attn-fill"] == 1


@pytest.mark.timeout(600)
def test_unavailable_pynccl_stays_off_in_capture(probes):
    assert probes["stock"]["pynccl-state"] == "enabled"
    assert probes["fixed"]["pynccl-state"] == "disabled"


def test_graph_fixes_idle_unless_asked(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_DISABLE", raising=False)
    monkeypatch.delenv(ENV, raising=False)
    for fix in FIXES:
        v = judge(fix, "0.5.23")
        assert v.state == "idle" and ENV in v.reason, fix.name
    monkeypatch.setenv(ENV, "1")
    for fix in FIXES:
        assert fix.family == "cpu" and judge(fix, "0.5.23").state == "active", fix.name
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    assert all(judge(f, "0.5.23").state == "idle" for f in FIXES)


def test_eager_replay_reruns_on_static_buffers(monkeypatch):
    """capture: 2 warm-ups + 1 recorded run; replay: the recorded callable again, its result
    copied into the captured output (fixed tensors, as a graph's)."""
    import types

    import torch
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    barriers = []
    monkeypatch.setattr("sglang.srt.runtime_context.get_parallel",
                        lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(barrier=lambda: barriers.append(1))))
    static_in = torch.zeros(4)
    calls = []

    def forward():
        calls.append(1)
        return (static_in * 2, {"h": static_in + 1})

    backend = make_backend(types.SimpleNamespace())
    assert isinstance(backend, FullCudaGraphBackend)
    backend.capture_one("bs4", forward)
    assert len(calls) == 3 and len(barriers) == 2 and backend.can_run(None, "bs4") and not backend.can_run(None, "bs2")
    captured = backend._outputs["bs4"]
    static_in.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    out = backend.replay("bs4", None)
    assert out is captured and out[0].tolist() == [2, 4, 6, 8] and out[1]["h"].tolist() == [2, 3, 4, 5]


def test_replay_undoes_the_prefill_forward_redirect(monkeypatch):
    """The prefill runner points layer_model.forward at a function calling replay()."""
    import types

    import torch

    monkeypatch.setattr("sglang.srt.runtime_context.get_parallel",
                        lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(barrier=lambda: None)))

    class Layers:
        def forward(self):
            return torch.ones(2)

    runner = types.SimpleNamespace(layer_model=Layers())
    backend = make_backend(runner)
    backend.capture_one("t16", lambda: runner.layer_model.forward())
    runner.layer_model.forward = lambda: backend.replay("t16", None)
    assert runner.layer_model.forward().tolist() == [1, 1]  # no recursion
    assert "forward" in runner.layer_model.__dict__  # the runner's redirect is back for its own restore


def test_copy_into_rejects_a_changed_shape():
    import torch

    with pytest.raises(RuntimeError, match=r"eager replay: output\[0\] is \(3,\), captured \(4,\)"):
        copy_into((torch.zeros(4),), (torch.zeros(3),))
