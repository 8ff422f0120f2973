"""The plan exchange of `retraction-routes` under DP attention, per extend step, on a real gloo group (the
backend of SGLang's TP CPU group), in --world processes of --dp DP slots.

  idle_step   a step without a retracted request (the common one): our exchange / SGLang's own MLP-sync
              gather of the same step (the 7-field int64 row per rank; 0.5.15 ... 0.5.22 all-gather it into
              one tensor, the releases slime and Miles run). 0.5.23's gather + broadcast
              (`exchange_sync_rows`) is measured beside it and printed as a fact.
  plan_step   a step where every DP slot re-prefills --rows kept rows (GLM-4.5: 92 layers, top-8 of 160):
              our exchange (one broadcast per slot, one byte per expert) / SGLang's own MLP-sync gather of a
              step (what every DP-attention step pays anyway). Every rank's plan all-gathered as a Python object
              (`all_gather_object`, int32) is measured beside it against the same sync and printed as a fact.
Each step is timed on every rank after a barrier; a step's time is its slowest rank's; arms alternate per
round and the ratios are medians over rounds.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _targets import fact, finish, judge  # noqa: E402

LAYERS, TOPK, EXPERTS, SYNC_FIELDS = 92, 8, 160, 7


def _rank(rank, world, dp, rows, rounds, store, out):
    import torch
    import torch.distributed as dist

    from sglang_patches.fixes.retraction_routes import exchange

    warnings.simplefilter("ignore", FutureWarning)   # torch's rename of all_gather_into_tensor, which SGLang calls
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group, slot = dist.group.WORLD, rank * dp // world
    try:
        from sglang.srt.managers.scheduler_components.dp_attn import exchange_sync_rows
    except ImportError:
        exchange_sync_rows = None
    gen = torch.Generator().manual_seed(slot)
    plan = (torch.arange(rows), torch.randint(0, EXPERTS, (rows, LAYERS, TOPK), generator=gen, dtype=torch.int32))
    row, table = torch.arange(SYNC_FIELDS, dtype=torch.int64), torch.empty(world * SYNC_FIELDS, dtype=torch.int64)
    arms = {
        "sync": lambda: dist.all_gather_into_tensor(table, row, group=group),
        "sync_0_5_23": (lambda: exchange_sync_rows(table, row, group)) if exchange_sync_rows else None,
        "idle": lambda: exchange(group, slot, None),
        "plan": lambda: exchange(group, slot, plan),
        "object": lambda: dist.all_gather_object([None] * world, (slot, plan), group=group),
    }
    times = {name: [] for name, fn in arms.items() if fn}
    for _ in range(rounds):
        for name in times:
            dist.barrier(group)
            t0 = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - t0)
    every = [None] * world
    dist.all_gather_object(every, times, group=group)
    if rank == 0:
        out.put({name: [max(r[name][i] for r in every) for i in range(rounds)] for name in times})
    dist.destroy_process_group()


def measure(world, dp, rows, rounds):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dp-exchange-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, dp, rows, rounds, os.path.join(tmp, "store"), out))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            return out.get(timeout=600)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8, help="ranks of the TP group (default 8; GLM-4.5: 32)")
    p.add_argument("--dp", type=int, default=4, help="DP slots (default 4, GLM-4.5's)")
    p.add_argument("--rows", type=int, default=2048, help="kept rows each slot re-prefills (default 2048)")
    p.add_argument("--rounds", type=int, default=15, help="rounds of every arm (default 15)")
    a = p.parse_args(argv)
    if a.world < 2 or a.dp < 1 or a.world % a.dp or a.rows < 1 or a.rounds < 1:
        p.error("--world must be >= 2 and a multiple of --dp; --rows and --rounds >= 1")
    t = measure(a.world, a.dp, a.rows, a.rounds)
    ms = {name: statistics.median(v) * 1e3 for name, v in t.items()}
    ratio = lambda x, y: statistics.median(b / c for b, c in zip(t[x], t[y]))  # noqa: E731
    print(f"{a.world} gloo ranks, {a.dp} DP slots, {a.rows} kept rows per slot; median step ms: "
          + ", ".join(f"{name} {v:.3f}" for name, v in ms.items()), flush=True)
    judge("dp_exchange", "idle_step", ratio("idle", "sync"))
    if "sync_0_5_23" in t:
        fact("dp_exchange", f"a step without plans, ours / 0.5.23's gather + broadcast: {ratio('idle', 'sync_0_5_23'):.2f}")
    per_plan = a.rows * LAYERS * TOPK
    fact("dp_exchange", f"bytes each rank receives in a plan step: ours {a.dp} x {per_plan:,} (one byte per expert), "
                        f"all_gather_object {a.world} x {per_plan * 4:,} (int32, padded to the largest)")
    fact("dp_exchange", f"a plan step by all_gather_object / SGLang's MLP-sync gather: {ratio('object', 'sync'):.2f}; "
                        f"ours / all_gather_object: {ratio('plan', 'object'):.3f}")
    judge("dp_exchange", "plan_step", ratio("plan", "sync"))
    return finish()


if __name__ == "__main__":
    sys.exit(main())
