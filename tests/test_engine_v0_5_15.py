"""Real SGLang 0.5.15.post1 (slime's version) and 0.5.16 (Miles') on CPU: configuration (a) with the CPU
fix family's ports.

The engine runs from the version's environment's python (`scripts/setup_sglang_env.sh <version>`):
this file's `__main__` is the child that launches it, generates and prints JSON;
the test compares the routed experts with transformers' router in this (0.5.23) process.
"""
import json
import os
import subprocess
import sys

import pytest

from support.variant_runs import python_of   # skips, or fails where make test requires the environment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS = ("0.5.15.post1", "0.5.16")
CPU_FIXES = {"cpu-host-register", "cpu-cuda-synchronize", "cpu-torch-native-fill", "cpu-ep-native-moe"}


def run_child(model: str, prompts: list, budget_s: float, disable: str) -> dict:
    """Launch config (a) on this interpreter's SGLang (SLIME_MOE_ROLLOUT_DISABLE=`disable`), generate
    each prompt, stop; returns a dict."""
    import tempfile
    import time

    from support.engines import active_fixes, generate, preset, start_engine, stop_engine

    from sglang_patches.registry import sglang_version

    t0 = time.monotonic()
    spec = preset("a", model, env={"SLIME_MOE_ROLLOUT_DISABLE": disable})
    eng = start_engine(spec, tempfile.mkdtemp(prefix=f"engine-v{sglang_version()}-"), budget_s)
    try:
        ready_s = time.monotonic() - t0
        outs = [generate(eng, ids, 6) for ids in prompts]
        return {"ready_s": ready_s, "fixes": active_fixes(eng), "outs": outs, "log": eng.log_path}
    finally:
        left = stop_engine(eng)[1]
        assert not left, f"engine processes left: {left}"


HOST_CACHE = """
import sys, threading, torch
if sys.argv[1] == "plugin":
    from sglang.srt.plugins import load_plugins
    load_plugins()
import sglang.srt.state_capturer.base as base

def pin_in_thread():  # what another thread gets while __init__ runs (at its allocation log line)
    out = []
    def pin():
        try:
            torch.zeros(1, pin_memory=True)
            out.append("pinned")
        except RuntimeError as e:
            out.append("refused" if "pin_memory=True requires a CUDA" in str(e) else str(e))
    t = threading.Thread(target=pin)
    t.start()
    t.join()
    seen.append((out[0], base.torch is torch))

seen = []
base.logger.info = lambda *a, **kw: pin_in_thread()
try:
    print("OK", tuple(base.BaseHostCache(4, 3, 2, name="x").buffer.shape), seen)
except RuntimeError as e:
    print("ERR", e)
"""


THREAD_BINDING = """
import os, sys
os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
if sys.argv[1] == "plugin":
    from sglang.srt.plugins import load_plugins
    load_plugins()
from sglang.srt.utils import numa_utils
from sglang.srt.utils.common import get_cpu_ids_by_node
n = len(get_cpu_ids_by_node())
try:  # as 0.5.16's ModelRunner.init_threads_binding calls it, one rank more than NUMA nodes
    got = numa_utils.init_threads_binding(tp_rank=n, tp_size=n + 1)
    cpus = {c for node in get_cpu_ids_by_node() for c in node.split(",")}
    print("OK", set(got.split(",")) <= cpus)
except AssertionError as e:
    print("ERR", str(e).splitlines()[0])
"""


def run_snippet(version, code, mode):
    env = dict(os.environ, PYTHONPATH=REPO, SGLANG_USE_CPU_ENGINE="1")
    env.pop("SGLANG_PLUGINS", None)
    return subprocess.run([python_of(version), "-c", code, mode], env=env, capture_output=True, text=True,
                          timeout=280).stdout.strip().splitlines()[-1]


def stock_and_plugin(version, code):
    """`code`'s last line on `version`, stock and with the plugin: two interpreters at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(lambda mode: run_snippet(version, code, mode), ("stock", "plugin")))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", VERSIONS)
def test_host_cache_unpinned(version):
    """cpu-host-register on 0.5.15 / 0.5.16: BaseHostCache pins with torch.zeros itself; stock dies on CPU torch.
    The hook is scoped to the call and its thread: another thread still gets torch's refusal meanwhile."""
    stock, plugin = stock_and_plugin(version, HOST_CACHE)
    assert stock.startswith("ERR pin_memory=True requires a CUDA or other accelerator backend"), stock
    assert plugin == "OK (4, 3, 2) [('refused', True)]", plugin


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_thread_binding_on_0_5_16():
    """cpu-thread-binding on 0.5.16: init_threads_binding(tp_rank=, tp_size=) asserts tp_size <= NUMA nodes
    without SGLANG_CPU_OMP_THREADS_BIND; with the plugin each rank gets a share of the node's CPUs."""
    stock, plugin = stock_and_plugin("0.5.16", THREAD_BINDING)
    assert "should be smaller than or equal to number of numa node" in stock, stock
    assert plugin == "OK True", plugin


def engine_a_on(version, model, prompts, disable=""):
    from support.engines import ENGINE_BUDGET_S

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    p = subprocess.run([python_of(version), __file__, model, json.dumps(prompts), str(ENGINE_BUDGET_S), disable],
                       env=env, capture_output=True, text=True, timeout=ENGINE_BUDGET_S + 300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", VERSIONS)
def test_a_routed_experts_match_transformers(tiny_model, version):
    from test_engine_single import check_routed, prompts

    ids = prompts(tiny_model)
    got = engine_a_on(version, tiny_model, ids)
    assert CPU_FIXES | {"capture-snapshot"} <= set(got["fixes"] or []), got["fixes"]
    for prompt, out in zip(ids, got["outs"]):
        check_routed(tiny_model, prompt, out)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_without_capture_snapshot_rows_hold_the_next_forwards_experts(tiny_model):
    """capture-snapshot disabled (stock 0.5.15.post1 capture): under overlap scheduling prompt row 0 and
    every decode row hold the experts of the token the next forward ran (prompt row 0: the first
    generated token; decode row r: row r + 1), and the other prompt rows are right."""
    from support.engines import decode_routed
    from rollout.models.reference import hf_router_topk
    from test_engine_single import prompts

    from rollout.models.tiny import NUM_LAYERS, TOP_K

    ids = prompts(tiny_model)
    got = engine_a_on("0.5.15.post1", tiny_model, ids, disable="capture-snapshot")
    assert "capture-snapshot" not in got["fixes"] and CPU_FIXES <= set(got["fixes"]), got["fixes"]
    for prompt, out in zip(ids, got["outs"]):
        full = list(prompt) + out["output_ids"]  # the last output token is forwarded by the overlap's extra step
        hf = hf_router_topk(tiny_model, full)
        routed = decode_routed(out["meta_info"]["routed_experts"], NUM_LAYERS, TOP_K)
        n, p = len(routed), len(prompt)
        source = [p] + list(range(1, p)) + [r + 1 for r in range(p, n)]  # whose experts each row holds
        for layer in range(1, NUM_LAYERS):
            got_rows = [sorted(x) for x in routed[:, layer, :].tolist()]
            wrong = [r for r in range(n) if got_rows[r] != hf[layer][r]]
            # A decode row can look right where two neighbouring tokens route alike (prompt 2: rows 14, 15).
            assert 0 in wrong and set(wrong) <= {0, *range(p, n)}, f"layer {layer}: rows differing: {wrong}"
            assert got_rows == [hf[layer][source[r]] for r in range(n)], f"layer {layer}: not the next forward's rows"


if __name__ == "__main__":
    import sglang

    assert sglang.__version__ in VERSIONS, sglang.__version__
    print(json.dumps(run_child(sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4])))
