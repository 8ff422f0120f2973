"""CPU burnt by an idle engine: the CPU engine profile (with SGLang's --sleep-on-idle) vs without it.

A real DP-attention SGLang CPU engine (configuration (c) by default: tp 4, dp 2 with DP attention,
ep 4, NEXTN, routed experts) is started twice, one after the other: as the engine profile launches it
(rollout.engines.command adds --sleep-on-idle on CPU) and with that one flag removed from the same
argv (SGLang's default: the scheduler busy-polls). After one request and a settle time, the CPU time
of EVERY process of the engine's tree (launcher, DP controller, schedulers, detokenizer) is sampled
over --window seconds. Printed per process; judged (benchmarks/targets.toml): total idle CPU with /
without the flag.
"""
import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _targets import finish, judge  # noqa: E402


def start(spec, sleep_on_idle: bool, log_dir: str):
    """The engine as the CPU profile launches it, or with --sleep-on-idle taken off the same argv;
    started by the local backend and admitted by phased readiness."""
    from rollout.engines.command import spec_commands
    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.readiness import LineView, start_ready
    from training_configs.schema import ReadinessBudgets   # the defaults: generous for a loaded machine

    def command(s):
        cmds = spec_commands(s)
        assert "--sleep-on-idle" in cmds[0].argv, "the CPU engine profile no longer adds --sleep-on-idle"
        if not sleep_on_idle:
            for c in cmds:
                c.argv = [a for a in c.argv if a != "--sleep-on-idle"]
        return cmds

    engine, _ = start_ready(LocalBackend(log_dir, command=command), spec, ReadinessBudgets(),
                            LineView(lambda text: print(f"  {text}", flush=True)))
    return engine


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="c", help="engine preset a|b|c (c: DP attention) or a config file")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds idle before sampling")
    ap.add_argument("--window", type=float, default=10.0, help="sampling window in seconds")
    a = ap.parse_args()
    import requests

    from rollout import config as rconfig
    from rollout.engines.process import alive_pids, cpu_percent
    from rollout.net import auth_headers, free_port
    from rollout.models.tiny import build_tiny_glm

    model = build_tiny_glm(variant="random")
    logs = tempfile.mkdtemp(prefix="bench-idle-")
    totals = {}
    for sleep_on_idle in (False, True):
        spec = rconfig.engine_specs(rconfig.load(a.config), model, ports=[free_port()])[0]
        eng = start(spec, sleep_on_idle, os.path.join(logs, f"sleep-on-idle-{sleep_on_idle}"))
        tree = eng.tree_pids()
        try:
            r = requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), timeout=600,
                              json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text[:300]
            time.sleep(a.settle)
            rows = cpu_percent(eng.tree_pids(), a.window)
        finally:
            eng.stop()
            left = alive_pids(tree)
        if left:
            sys.exit(f"error: processes left after stop: {left}")
        label = "with --sleep-on-idle (our CPU profile)" if sleep_on_idle else "without (SGLang's default)"
        print(f"  {label}: idle CPU per process over {a.window:.0f} s")
        for pid, (title, pct) in sorted(rows.items()):
            print(f"    {pct:6.1f}%  pid {pid:<7d} {title}")
        totals[sleep_on_idle] = sum(p for _, p in rows.values())
        print(f"    {totals[sleep_on_idle]:6.1f}%  total ({len(rows)} processes)", flush=True)
    print(f"idle CPU: configuration ({a.config}), every process of the engine: without {totals[False]:.1f}%, "
          f"with --sleep-on-idle {totals[True]:.1f}% of one core")
    judge("idle_cpu", "total", totals[True] / max(totals[False], 1e-6))
    return finish()


if __name__ == "__main__":
    sys.exit(main())
