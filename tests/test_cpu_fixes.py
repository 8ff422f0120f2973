"""CPU fix family: each defect reproduced without our plugin and gone with it.

Hooks are process-global, so one probe subprocess runs every check with the plugin disabled
(`SGLANG_PLUGINS=none`) and another with it loaded (SGLang's own `load_plugins()`); a third run
disables a single fix by name (`SLIME_MOE_ROLLOUT_DISABLE`). Each check calls the hooked SGLang
function itself with the smallest input that shows the defect.
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_patches.cpu.fixes import FIXES
from sglang_patches.cpu.fixes.ep_native_moe import fill_remote_slots
from sglang_patches.cpu.fixes.thread_binding import split_cpus
from sglang_patches.registry import judge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r'''
import json, os, sys, traceback, types
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from support.gloo import run_ranks
os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
from sglang.srt.plugins import load_plugins
load_plugins()
NS = types.SimpleNamespace
results = {}

def check(name):
    def deco(fn):
        try:
            fn()
            results[name] = "ok"
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return fn
    return deco

@check("cpu-host-register")
def _():
    from sglang.srt.mem_cache.pool_host import common
    class Alloc:
        def allocate(self, dims, dtype, device):
            return torch.zeros(dims, dtype=dtype, device=device)
    buf = common.ALLOC_MEMORY_FUNCS["cpu"]((4, 8), torch.int32, "cpu", True, Alloc())
    assert buf.shape == (4, 8)

@check("cpu-cuda-synchronize")
def _():
    from torch import nn
    from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
    fake = NS(model=NS(embed_tokens=nn.Embedding(4, 2)), lm_head=nn.Linear(2, 4))
    e, h = nn.Parameter(torch.ones(4, 2)), nn.Parameter(torch.ones(4, 2))
    Glm4MoeForCausalLM.set_embed_and_head(fake, e, h)
    assert fake.lm_head.weight is h and fake.model.embed_tokens.weight is e

@check("cpu-eagle-attn-backend")
def _():
    from sglang.srt.arg_groups import overrides
    from sglang.srt.runtime_context import get_platform
    assert not get_platform().has_amx, "this CPU has AMX: defect not reproducible here"
    view = NS(attention_backend="intel_amx", device="cpu", speculative_algorithm="NEXTN")
    got = overrides._attention_backend_platform_fallbacks(view)
    assert got == {}, f"intel_amx rewritten: {got}"
    # Without speculative decoding SGLang's fallback stays (torch_native is the faster choice).
    plain = NS(attention_backend="intel_amx", device="cpu", speculative_algorithm=None)
    assert overrides._attention_backend_platform_fallbacks(plain) == {"attention_backend": "torch_native"}

@check("cpu-torch-native-fill")
def _():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    b = TorchNativeAttnBackend(NS(device="cpu", req_to_token_pool=None, token_to_kv_pool=None))
    assert b.get_cpu_graph_seq_len_fill_value() == 1

@check("cpu-ep-native-moe")
def _():
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    g = torch.Generator().manual_seed(0)
    E, H, I = 4, 8, 6  # 4 local experts on this EP rank
    w13 = torch.randn(E, 2 * I, H, generator=g); w2 = torch.randn(E, H, I, generator=g)
    x = torch.randn(3, H, generator=g)
    ids = torch.tensor([[0, -1], [2, 3], [-1, -1]], dtype=torch.int32)
    w = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]])
    cfg = NS(apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None, gemm1_clamp_limit=None)
    out = moe_forward_native(NS(num_experts=E, w13_weight=w13, w2_weight=w2), x, StandardTopKOutput(w, ids, None), cfg)
    ref = torch.zeros(3, H)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            if e >= 0:
                gu = w13[e] @ x[t]
                ref[t] += w[t, k] * (w2[e] @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
    assert torch.allclose(out, ref, atol=1e-4), f"max diff {(out - ref).abs().max()}"

def _collectives(rank, which):
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    grp = dist.group.WORLD
    # A stand-in for a CPU GroupCoordinator: gloo device group, no pynccl (CPU has none usable).
    fake = NS(world_size=2, rank_in_group=rank, device_group=grp, pynccl_comm=None, ca_comm=None,
              pymscclpp_comm=None)
    fake.all_reduce = lambda t: (dist.all_reduce(t, group=grp), t)[1]
    for m in ("_deterministic_reduce_scatterv", "_all_gather_into_tensor"):
        setattr(fake, m, types.MethodType(getattr(GroupCoordinator, m), fake))
    if which == "varsize":
        sizes = [1, 3]
        full = torch.arange(8.0).view(4, 2) * (rank + 1)
        rs = GroupCoordinator.reduce_scatterv(fake, full, sizes=sizes)
        want = (torch.arange(8.0).view(4, 2) * 3)[sum(sizes[:rank]):sum(sizes[:rank + 1])]
        assert torch.equal(rs, want), f"reduce_scatterv {rs.tolist()} != {want.tolist()}"
        mine = torch.full((sizes[rank], 2), float(rank))
        out = torch.empty(4, 2)
        ag = GroupCoordinator.all_gatherv(fake, mine, sizes=sizes, output=out)
        want = torch.tensor([[0.0, 0.0], [1, 1], [1, 1], [1, 1]])
        assert torch.equal(out, want) and ag[0] is out, f"all_gatherv {out.tolist()}"
    else:
        shard = torch.full((3, 5), float(rank))
        out = torch.empty(2, 3, 5)  # stacked (world, tokens, shard), as _gather_attn_tp_logits allocates
        GroupCoordinator.all_gather_into_tensor(fake, out, shard)
        assert torch.equal(out[1], torch.ones(3, 5)) and torch.equal(out[0], torch.zeros(3, 5))

def _run_collectives(which):
    bad = [verdict for _, verdict, _ in run_ranks(_collectives, which, start="fork") if verdict != "ok"]
    assert not bad, bad[0]

@check("cpu-gloo-scatter-gather")
def _():
    _run_collectives("varsize")

@check("cpu-gloo-stacked-allgather")
def _():
    _run_collectives("stacked")

@check("cpu-thread-binding")
def _():
    from sglang.srt.utils.common import get_cpu_ids_by_node
    from sglang.srt.utils.numa_utils import init_threads_binding
    n = len(get_cpu_ids_by_node())
    got = init_threads_binding(numa_index=n, world_size=n + 1)  # one rank more than NUMA nodes
    cpus = {c for node in get_cpu_ids_by_node() for c in node.split(",")}
    assert got and set(got.split(",")) <= cpus, got

@check("cpu-dp-controller-idle")
def _():
    import threading, time, zmq
    from sglang.srt.managers.data_parallel_controller import DataParallelController
    from sglang.srt.managers.io_struct import sock_send
    class Stop(Exception):
        pass
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    t0, turns, sent, got = time.monotonic(), [0], [], []
    def feed():  # the soft watchdog is fed once per loop turn
        turns[0] += 1
        if time.monotonic() - t0 > 2.5:
            raise Stop
    def send():
        time.sleep(0.7)
        sent.append(time.monotonic())
        sock_send(push, [1, 2, 3])
    ctl = NS(server_args=NS(sleep_on_idle=True), recv_from_tokenizer=pull, soft_watchdog=NS(feed=feed),
             _request_dispatcher=lambda req: got.append((time.monotonic(), req)))
    threading.Thread(target=send, daemon=True).start()
    try:
        DataParallelController.event_loop(ctl)  # SGLang's own loop, an idle socket but for one message
    except Stop:
        pass
    finally:
        push.close(0); pull.close(0); ctx.term()
    assert [r for _, r in got] == [[1, 2, 3]], f"dispatched {got}"
    delay_ms = 1000 * (got[0][0] - sent[0])
    assert delay_ms < 100, f"the message waited {delay_ms:.0f} ms"
    assert turns[0] <= 10, f"busy-poll: {turns[0]} loop turns in 2.5 s with sleep_on_idle and one message"

print("PROBE-RESULTS " + json.dumps(results))
'''

NAMES = [f.name for f in FIXES]


def run_probe(**env_over) -> dict:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    for k in ("SGLANG_PLUGINS", "SLIME_MOE_ROLLOUT_DISABLE"):
        env.pop(k, None)
    env.update(env_over)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-RESULTS "):
            return json.loads(line.split(" ", 1)[1])
    raise AssertionError(f"probe failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def probes():
    """Three probe runs in parallel: stock SGLang, our plugin, plugin minus one fix."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as ex:
        stock = ex.submit(run_probe, SGLANG_PLUGINS="none")
        fixed = ex.submit(run_probe)
        minus = ex.submit(run_probe, SLIME_MOE_ROLLOUT_DISABLE="cpu-ep-native-moe")
        return {"stock": stock.result(), "fixed": fixed.result(), "minus": minus.result()}


@pytest.mark.parametrize("name", NAMES)
def test_fix_needed_and_effective(probes, name):
    assert probes["stock"][name] != "ok", f"{name}: defect not reproduced on stock SGLang"
    assert probes["fixed"][name] == "ok", f"{name}: still failing with the plugin: {probes['fixed'][name]}"


def test_stock_failures_are_the_documented_ones(probes):
    s = probes["stock"]
    assert "Torch not compiled with CUDA" in s["cpu-host-register"]
    assert "Torch not compiled with CUDA" in s["cpu-cuda-synchronize"]
    assert "torch_native" in s["cpu-eagle-attn-backend"]
    assert "get_cpu_graph_seq_len_fill_value" in s["cpu-torch-native-fill"]
    assert "index -1" in s["cpu-ep-native-moe"]
    assert s["cpu-thread-binding"].startswith("AssertionError")
    assert "invalid tensor size" in s["cpu-gloo-stacked-allgather"]
    assert s["cpu-dp-controller-idle"].startswith("AssertionError: busy-poll:")


def test_disable_one_fix_by_name(probes):
    m = probes["minus"]
    assert m["cpu-ep-native-moe"] != "ok"
    assert all(m[n] == "ok" for n in NAMES if n != "cpu-ep-native-moe")


def test_fixes_idle_off_cpu_engine(monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    for fix in FIXES:
        v = judge(fix, "0.5.23")
        assert v.state == "idle" and "SGLANG_USE_CPU_ENGINE" in v.reason


def test_fingerprints_match_installed_sglang(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_DISABLE", raising=False)
    for fix in FIXES:
        assert fix.family == "cpu" and fix.test.startswith("tests/test_cpu_fixes.py::")
        assert judge(fix, "0.5.23").state == "active", fix.name


def test_fill_remote_slots_rows_stay_distinct():
    import torch

    ids = torch.tensor([[-1, 3, -1, 0], [-1, -1, -1, -1], [1, 2, 3, 0]])
    w = torch.ones(3, 4)
    nw, nid = fill_remote_slots(w, ids, 4)
    for row in nid.tolist():
        assert sorted(row) == [0, 1, 2, 3]
    assert nw[0].tolist() == [0, 1, 0, 1] and nw[1].sum() == 0 and nw[2].sum() == 4
    with pytest.raises(RuntimeError, match="top-k 4 exceeds"):
        fill_remote_slots(w, ids, 3)


def test_split_cpus():
    assert split_cpus(2, [0, 1]) == "0|1"
    assert split_cpus(4, [0, 1]) == "0|1|0|1"
    assert split_cpus(2, [0, 1, 2, 3]) == "0,1|2,3"


EVENT_LOOP = "bc008a8481258e79"  # DataParallelController.event_loop, measured on every reviewed release
GUARD_PROBE = r'''
import json
from sglang_patches.cpu.fixes import dp_controller_idle as d
from sglang_patches.fingerprint import fingerprint, source_of
from sglang_patches.registry import detect, judge
print("GUARD " + json.dumps({"variant": detect().variant.name, "event_loop": fingerprint(d.TARGET),
                             "loads_plugins": "load_plugins()" in source_of(d.CONTROLLER_PROCESS),
                             "state": judge(d.FIX, detect()).state}))
'''


@pytest.mark.timeout(600)
def test_dp_controller_idle_unreachable_on_older_variants():
    """The same busy-poll on every release; where the DP controller process never loads plugins (up to
    0.5.21) the fix is not-needed, where it does (0.5.22, 0.5.23) it is hooked."""
    from sglang_patches.scenarios.runner import env_python

    from sglang_patches.cpu.fixes import dp_controller_idle as d
    from sglang_patches.registry import VARIANTS, table

    pythons = {v.name: sys.executable if v.name == "0.5.23" else env_python(v.name) for v in VARIANTS}
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=ROOT)
    env.pop("SLIME_MOE_ROLLOUT_DISABLE", None)

    def probe(item):
        variant, py = item
        r = subprocess.run([str(py), "-c", GUARD_PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=240)
        line = [x for x in r.stdout.splitlines() if x.startswith("GUARD ")]
        assert line, f"{variant}: guard probe failed:\n{r.stderr[-2000:]}"
        return variant, json.loads(line[0].split(" ", 1)[1])

    with ThreadPoolExecutor(max_workers=2) as pool:   # two releases at a time: one SGLang import each
        seen = dict(pool.map(probe, [(v, py) for v, py in pythons.items() if os.path.exists(py)]))
    for variant, got in seen.items():
        state = table(next(v.table for v in VARIANTS if v.name == variant))[d.FIX.name].state.value
        assert got == {"variant": variant, "event_loop": EVENT_LOOP, "loads_plugins": state == "active",
                       "state": state}, variant
    if len(seen) < len(pythons):
        pytest.skip(f"checked on {sorted(seen)} only: build the others with scripts/setup_sglang_env.sh")
