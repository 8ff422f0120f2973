"""kill -9 of a real engine mid-rollout, repeated: every group must arrive exactly once each time.

    flock /tmp/engine.lock timeout 7200 .venv/bin/python scripts/kill_engine_repeat.py [--iterations 20]
        [--engines 2] [--groups 8] [--budget-s 5400] [--tally tally.json]

Starts the tiny-cpu config's engines once (real SGLang CPU, routed experts on) under one
RolloutManager; each iteration starts a rollout, waits until requests are in flight, kill -9s an
admitted engine (round robin), waits for the rollout, and checks that the groups delivered are
exactly the groups asked for, once each, every sample finished with one routed-expert row per token.
The killed engine restarts in the background (the others carry the load meanwhile; with every
engine dead the rollout waits for a re-admission). Prints one line per iteration and the tally;
exits 1 if any iteration lost or duplicated a group. Stops early (saying so) when --budget-s is spent.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _config(engines: int, max_new_tokens: int):
    from rollout import config as rconfig

    cfg = rconfig.load(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml"))
    cfg.engine_groups[0].engines = engines
    cfg.rollout.sampling.max_new_tokens = max_new_tokens
    cfg.rollout.health.interval_s = 1.0
    for k in ("http_s", "server_up_s", "health_generate_s", "dp_probe_s"):  # loaded machine: slow starts
        setattr(cfg.rollout.budgets, k, 600.0)
    return cfg


def _check(asked: list, got: list) -> str:
    """'' when `got` is exactly the asked groups once each with finished, fully routed samples."""
    ids = [g.group_id for g in got]
    if sorted(ids) != sorted(g.group_id for g in asked):
        missing = {g.group_id for g in asked} - set(ids)
        dup = len(ids) - len(set(ids))
        return f"missing {sorted(missing)}, {dup} duplicate(s)"
    for g in got:
        for s in g.samples:
            if not s.status.finished:
                return f"{s.sample_id}: {s.status.value} ({s.error})"
            if s.routed_experts is None or s.routed_experts.shape[0] != len(s.tokens) - 1:
                return f"{s.sample_id}: routed-expert rows do not match its tokens"
    return ""


async def _iteration(mgr, k: int, groups: int, prompt_len: int) -> dict:
    from rollout.types import EngineEvent
    from rollout.stream import GroupStream

    asked = [mgr.new_group([(7 * (k * groups + i) + j) % 290 + 5 for j in range(prompt_len)]) for i in range(groups)]
    stream = GroupStream(maxsize=groups * 2)
    deaths0 = mgr.count(EngineEvent.DEAD)
    task = asyncio.create_task(mgr.rollout(asked, stream, batch_size=groups))
    t0 = time.monotonic()
    while not any(s.outstanding for s in mgr.dispatcher.slots.values()):
        if task.done():
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    names = sorted(mgr.dispatcher.slots)
    victim = names[k % len(names)] if names else None
    killed = None
    if victim and not task.done():
        killed = mgr.source.engines[victim]
        os.kill(killed.pid, signal.SIGKILL)
    res = await task
    await stream.close()
    got = [g async for g in stream]
    problem = _check(asked, got) if killed else "the rollout finished before the kill"
    return {"iteration": k, "killed": victim if killed else None, "groups": len(got), "asked": groups,
            "resent": res.resent, "deaths": mgr.count(EngineEvent.DEAD) - deaths0,
            "wall_s": round(time.monotonic() - t0, 1), "ok": not problem, "problem": problem}


async def main(args) -> int:
    from rollout.cli.engine import model_for
    from rollout.engines.fleet import Restarts
    from rollout.engines.local_backend import LocalBackend
    from rollout.manager import RolloutManager
    from rollout.net import free_port

    cfg = _config(args.engines, args.max_new_tokens)
    model = model_for(cfg, ROOT)
    logs = tempfile.mkdtemp(prefix="kill-engine-repeat-")
    mgr = RolloutManager.from_config(cfg, LocalBackend(logs), model, ports=[free_port() for _ in range(args.engines)],
                                     restarts=Restarts(max_restarts=1000))
    t_start = time.monotonic()
    tally = {"iterations": [], "engines": args.engines, "groups_per_iteration": args.groups, "logs": logs}
    print(f"starting {args.engines} engine(s) (logs in {logs})", flush=True)
    async with mgr:
        print(f"engines ready after {time.monotonic() - t_start:.0f} s", flush=True)
        for k in range(args.iterations):
            if time.monotonic() - t_start > args.budget_s or (args.stop_at and time.time() > args.stop_at):
                print(f"budget of {args.budget_s:.0f} s spent after {k} iteration(s): stopping early", flush=True)
                tally["stopped_early"] = f"budget {args.budget_s:.0f} s spent"
                break
            it = await _iteration(mgr, k, args.groups, 12)
            tally["iterations"].append(it)
            print(json.dumps(it), flush=True)
    runs = tally["iterations"]
    tally["ok"] = sum(r["ok"] for r in runs)
    tally["failed"] = len(runs) - tally["ok"]
    tally["wall_s"] = round(time.monotonic() - t_start, 1)
    print(f"tally: {tally['ok']} of {len(runs)} iteration(s) delivered every group exactly once "
          f"({tally['failed']} failed) in {tally['wall_s']:.0f} s", flush=True)
    if args.tally:
        with open(args.tally, "w") as fh:
            json.dump(tally, fh, indent=1)
    return 0 if runs and tally["failed"] == 0 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=5400.0, help="stop starting iterations after this")
    ap.add_argument("--stop-at", type=float, default=None, help="also stop starting iterations after this Unix time")
    ap.add_argument("--tally", default=None, help="write the tally as JSON here")
    sys.exit(asyncio.run(main(ap.parse_args())))
