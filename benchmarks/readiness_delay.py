"""Readiness and death detection: this manager vs slime's own semantics, watching the SAME real engine.

One real SGLang CPU engine (tiny GLM-4.5 MoE, one engine of training_configs/tiny-cpu.yaml).
Readiness, side by side on one engine start:
  ours : RolloutManager.start: phased readiness, admitted after /health_generate 200 AND a one-token
         probe on every DP rank (the manager's "admitted" event);
  slime: slime's `_wait_server_healthy` (slime/backends/sglang_utils/sglang_engine.py):
         GET /health_generate every 2 s until 200. With --slime-src DIR, slime's own function runs
         (in a thread); without, the same semantics re-stated here (`slime_wait`).
Death, side by side on one rollout: the engine is killed with SIGKILL mid-rollout. Where the kill lands in
slime's cadence decides slime's delay, so several slime monitors watch the same engine, their checks
staggered so that the kill lands at phases spread evenly over one interval (--phases):
  ours : the manager declares the engine dead (process watch / health monitor, "dead" event);
  slime: RolloutHealthMonitor semantics (slime/utils/health_monitor.py): /health_generate every
         --rollout-health-check-interval (default 30 s) with a 30 s timeout; a failed check kills it.
Judged (benchmarks/targets.toml): ready = ours / slime seconds from launch; death = ours / slime's mean
seconds from the kill over the phases (a kill at a random moment); the worst phase for us is printed.
"""
import argparse
import asyncio
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _targets import fact, finish, judge  # noqa: E402
from _tiny import one_engine_config, started_manager  # noqa: E402

from rollout.net import auth_headers  # noqa: E402
from rollout.types import EngineEvent  # noqa: E402

SLIME_HEALTH_INTERVAL_S = 30.0  # slime/utils/arguments.py: --rollout-health-check-interval default
SLIME_HEALTH_TIMEOUT_S = 30.0   # --rollout-health-check-timeout default


def slime_wait(base_url, api_key, is_process_alive):
    """slime's _wait_server_healthy semantics: GET /health_generate, 200 -> ready; else sleep 2 s."""
    import requests

    with requests.Session() as s:
        while True:
            try:
                if s.get(f"{base_url}/health_generate", headers=auth_headers(api_key)).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if not is_process_alive():
                raise RuntimeError("Server process terminated unexpectedly.")
            time.sleep(2)


def slime_health_loop(url, api_key, stop: threading.Event, checked: list, start_at: float) -> float:
    """RolloutHealthMonitor semantics from `start_at` (monotonic): a check every interval; returns when a check
    fails (declared dead)."""
    import requests

    if stop.wait(max(0.0, start_at - time.monotonic())):
        return float("nan")
    while not stop.is_set():
        checked.append(time.monotonic())
        try:
            requests.get(f"{url}/health_generate", headers=auth_headers(api_key),
                         timeout=SLIME_HEALTH_TIMEOUT_S).raise_for_status()
        except requests.RequestException:
            return time.monotonic()
        if stop.wait(SLIME_HEALTH_INTERVAL_S):
            return float("nan")
    return float("nan")


def slime_wait_fn(slime_src):
    if not slime_src:
        return slime_wait, "slime's semantics (re-stated)"
    if not os.path.isdir(os.path.join(slime_src, "slime")):
        sys.exit(f"error: --slime-src {slime_src} has no slime/ package")
    sys.path.insert(0, slime_src)
    from slime.backends.sglang_utils.sglang_engine import _wait_server_healthy
    return _wait_server_healthy, f"slime's own _wait_server_healthy ({slime_src})"


async def run(args):
    from rollout.cli.run import prompts_for
    from rollout.stream import GroupStream

    wait_fn, wait_what = slime_wait_fn(args.slime_src)
    cfg, model = one_engine_config(args.max_new_tokens)
    box = {}

    def slime_watch():
        """Waits until the manager has launched the engine, then runs slime's wait on it."""
        while not box.get("mgr") or not box["mgr"].engines:
            time.sleep(0.01)
        eng = next(iter(box["mgr"].engines.values()))
        wait_fn(eng.url, eng.api_key, eng.alive)
        box["slime_ready"] = time.monotonic()

    watcher = threading.Thread(target=slime_watch, daemon=True)
    watcher.start()
    mgr = await started_manager(cfg, model, "bench-ready-", on_created=lambda m: box.__setitem__("mgr", m))
    try:
        await asyncio.to_thread(watcher.join, 600)
        ev = {e.kind: e.t for e in mgr.events}
        t_launch, t_ours, t_slime = ev[EngineEvent.STARTED], ev[EngineEvent.ADMITTED], box["slime_ready"]
        print("readiness: 1 real SGLang CPU engine; seconds from launch to declared ready")
        print(f"  ours (health_generate + one-token probe per DP rank): {t_ours - t_launch:6.2f} s")
        print(f"  slime ({wait_what}, 2 s polls)     : {t_slime - t_launch:6.2f} s")
        judge("readiness_delay", "ready", (t_ours - t_launch) / (t_slime - t_launch))

        # death mid-rollout
        mgr.max_restarts = 0  # no restart: the benchmark ends at detection
        eng = next(iter(mgr.engines.values()))
        stream = GroupStream(maxsize=10_000)
        rollout = asyncio.create_task(mgr.rollout(prompts_for(300, args.death_groups, seed=7), stream))
        # monitor i checks first at t0 + (1 - phase_i) * interval: the kill at t0 + interval lands phase_i of an
        # interval after its last check, so it sees the death (1 - phase_i) * interval after the kill
        phases = [(i + 0.5) / args.phases for i in range(args.phases)]
        t0, stop = time.monotonic() + 1.0, threading.Event()
        checks = [[] for _ in phases]
        monitors = [asyncio.create_task(asyncio.to_thread(
            slime_health_loop, eng.url, eng.api_key, stop, checks[i], t0 + (1 - p) * SLIME_HEALTH_INTERVAL_S))
            for i, p in enumerate(phases)]
        await asyncio.sleep(max(0.0, t0 + SLIME_HEALTH_INTERVAL_S - time.monotonic()))
        if rollout.done():
            sys.exit("error: the rollout finished before the kill; raise --death-groups")
        t_kill = time.monotonic()
        eng.kill(signal.SIGKILL)
        slime_dead = [t - t_kill for t in await asyncio.gather(*monitors)]
        while not any(e.kind == EngineEvent.DEAD for e in mgr.events if e.t >= t_kill):
            await asyncio.sleep(0.01)
        t_ours_dead = min(e.t for e in mgr.events if e.t >= t_kill and e.kind == EngineEvent.DEAD)
        stop.set()
        rollout.cancel()
        try:
            await rollout
        except BaseException:
            pass
    finally:
        await mgr.stop()
    ours = t_ours_dead - t_kill
    print(f"death detection: SIGKILL mid-rollout (slime's interval {SLIME_HEALTH_INTERVAL_S:.0f} s, timeout "
          f"{SLIME_HEALTH_TIMEOUT_S:.0f} s: defaults)")
    print(f"  ours : declared dead after {ours:6.2f} s")
    for p, s in zip(phases, slime_dead):
        print(f"  slime, kill {p * SLIME_HEALTH_INTERVAL_S:4.1f} s after its last check: declared dead after {s:6.2f} s")
    fact("readiness_delay", f"worst phase for us (kill just before slime's next check): ours / slime "
                            f"{ours / min(slime_dead):.2f}")
    judge("readiness_delay", "death", ours / (sum(slime_dead) / len(slime_dead)))
    return finish()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slime-src", help="a THUDM/slime checkout: run slime's own _wait_server_healthy")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--death-groups", type=int, default=1000, help="a rollout long enough to be killed mid-way")
    ap.add_argument("--phases", type=int, default=6, help="kill phases spread over slime's interval (default 6)")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
