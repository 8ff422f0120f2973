"""Processes in one real gloo group (the world group), for checks of collectives on CPU."""
import multiprocessing as mp
import os
import queue
import tempfile
from datetime import timedelta


def _rank(target, rank, world, store, out, args):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        out.put((rank, "ok", target(rank, *args)))
    except Exception as e:
        first = str(e).splitlines()[0][:200] if str(e) else ""
        out.put((rank, f"{type(e).__name__}: {first}", None))
    finally:
        dist.destroy_process_group()


def run_ranks(target, *args, world=2, start="spawn", budget_s=60):
    """Run `target(rank, *args)` in `world` processes joined in one gloo group. Returns one (rank, "ok" or
    "<Error>: <first line>", value) per rank in rank order; a rank that never reports reads "timeout".
    `start="fork"` where `target` lives in a `python -c` script (spawn cannot import it there)."""
    ctx = mp.get_context(start)
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gloo-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(target, r, world, store, out, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in procs:  # once a rank failed, its peer may hang in gloo: don't wait long for it
                ok = all(v[1] == "ok" for v in got.values())
                rank, verdict, value = out.get(timeout=budget_s if ok else 5)
                got[rank] = (rank, verdict, value)
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return [got.get(r, (r, "timeout: the rank never reported", None)) for r in range(world)]
