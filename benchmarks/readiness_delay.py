"""Readiness and death detection delay: phased readiness vs a 2 s polling loop, on the same engine start.

One real SGLang CPU engine is started once; three watchers run side by side on that start:
  reference : GET /ready every 0.05 s -> the moment the server status turned Up
  ours      : rollout.engines.readiness.wait_ready (0.2 s polls) -> /health_generate 200 seen, then admitted
              (admission also needs the one-token probe on every DP rank)
  2 s loop  : slime's wait: GET /health_generate every 2 s until 200
Death detection is then timed on stand-in processes (see `death`). Printed: delays and ratios.
"""
import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _tiny import one_engine_config  # noqa: E402


async def reference_up(session, eng, t0):
    while True:
        try:
            async with session.get(eng.url + "/ready", headers={"Authorization": f"Bearer {eng.api_key}"}) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except Exception:
            pass
        await asyncio.sleep(0.05)


async def two_second_loop(session, eng, t0):
    import aiohttp
    while True:
        if not eng.alive():
            raise RuntimeError("engine died")
        try:
            async with session.get(eng.url + "/health_generate", timeout=aiohttp.ClientTimeout(total=30),
                                   headers={"Authorization": f"Bearer {eng.api_key}"}) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except Exception:
            pass
        await asyncio.sleep(2.0)


async def ours(session, eng, budgets, t0):
    from rollout.engines.readiness import PHASES, wait_ready
    info = await wait_ready(eng, budgets, session)
    t_admit = time.monotonic() - t0
    labels = [p.label for p in PHASES]
    t_health = t_admit - info.phase_s[labels[-1]]  # health_generate passed where the DP probe began
    return t_health, t_admit


async def death(trials: int):
    """Death detection on STAND-IN processes (`sleep`; the scenario is about the process only):
    our health monitor's 0.25 s process check vs a loop that checks liveness every 2 s (slime's
    wait loop), each killed with SIGKILL at a random phase of the 2 s loop."""
    import subprocess

    from rollout.engines.health import HealthMonitor

    class Proc:
        def __init__(self):
            self.p = subprocess.Popen(["sleep", "600"])
            self.name = f"standin-{self.p.pid}"

        def alive(self):
            return self.p.poll() is None

        def exit_reason(self):
            return "killed"

    ours, slow = [], []
    for _ in range(trials):
        proc, seen = Proc(), {}
        t_kill = [0.0]

        async def on_dead(e, reason):
            seen["ours"] = time.monotonic() - t_kill[0]

        async def probe(e):
            pass

        mon = HealthMonitor(probe, on_dead, interval_s=30, failures=3)
        mon.watch(proc)
        mon.start()

        async def two_s():
            while proc.alive():
                await asyncio.sleep(2.0)
            seen["slow"] = time.monotonic() - t_kill[0]

        task = asyncio.create_task(two_s())
        await asyncio.sleep(random.uniform(0.0, 2.0))
        t_kill[0] = time.monotonic()
        proc.p.kill()
        await task
        while "ours" not in seen:
            await asyncio.sleep(0.01)
        await mon.stop()
        ours.append(seen["ours"])
        slow.append(seen["slow"])
    return sum(ours) / trials, sum(slow) / trials


async def run(args):
    import aiohttp

    from rollout import config as rconfig
    from rollout.engines.engine_launch import free_port
    from rollout.engines.lifecycle import LocalBackend

    cfg, model = one_engine_config()
    spec = rconfig.engine_specs(cfg, model, ports=[free_port()])[0]
    rows = []
    for r in range(args.rounds):
        eng = LocalBackend(tempfile.mkdtemp(prefix="bench-ready-")).start(spec)
        t0 = time.monotonic()
        try:
            async with aiohttp.ClientSession() as s:
                up, slime, (health, admit) = await asyncio.gather(
                    reference_up(s, eng, t0), two_second_loop(s, eng, t0), ours(s, eng, cfg.rollout.budgets, t0))
        finally:
            eng.stop()
            assert eng.leftover_pids() == []
        rows.append((up, health, admit, slime))
        print(f"  round {r + 1}: Up at {up:.2f} s; ours saw /health_generate 200 at {health:.2f} s, admitted at "
              f"{admit:.2f} s; 2 s loop at {slime:.2f} s", file=sys.stderr)
    up, health, admit, slime = [sum(x) / len(x) for x in zip(*rows)]
    d_ours, d_slow = await death(args.death_trials)
    print(f"readiness delay: 1 real SGLang CPU engine, {args.rounds} start(s), delays after the server turned Up "
          f"({up:.1f} s after launch)")
    print(f"  ours, /health_generate 200 seen : {health - up:6.2f} s")
    print(f"  ours, admitted (+ DP-rank probes): {admit - up:6.2f} s")
    print(f"  2 s polling loop                 : {slime - up:6.2f} s")
    print(f"  2 s loop / ours (health seen)    : {(slime - up) / max(health - up, 1e-3):.1f}x")
    print(f"  death detection ({args.death_trials} stand-in processes, SIGKILL at a random phase): "
          f"ours {d_ours:.2f} s vs 2 s loop {d_slow:.2f} s mean ({d_slow / max(d_ours, 1e-3):.1f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--death-trials", type=int, default=20)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
