"""Run the benchmarks listed in benchmarks/targets.toml and judge them.

    python benchmarks/run_all.py           # make bench: every benchmark, full size; exit 1 on a MISS or a crash
    python benchmarks/run_all.py --quick   # make bench-quick: the benchmarks that have `quick_args`, small;
                                           # a MISS is reported, not failed (timing on a shared machine is
                                           # no test); a crash or a missing judged line fails
Benchmarks that start real SGLang engines are marked `engine = true` (not in --quick). On a machine
shared with other engine jobs, run the whole thing under `flock /tmp/engine.lock make bench`.
"""
import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _targets import MISS_EXIT, table  # noqa: E402

LINE = re.compile(r"^(\S+): ratio \S+ \(target (?:>=|<=) \S+\) (PASS|MISS)$", re.M)


def scripts() -> list:
    return sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("_")
                  and f != "run_all.py")


def run_one(name: str, spec: dict, quick: bool) -> tuple:
    """(status, judged lines): status is 'ok', 'miss' or a one-line error."""
    cmd = [sys.executable, os.path.join(HERE, name + ".py")] + list(spec.get("quick_args" if quick else "args", []))
    slime_src = os.environ.get("SLIME_SRC") if spec.get("slime_src") else None
    if slime_src:  # the benchmark runs slime's own code as its peer arm
        cmd += ["--slime-src", slime_src]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(p.stdout)
    judged = LINE.findall(p.stdout)
    wanted = {f"{name}.{t}" for t, v in spec["targets"].items() if slime_src or not v.get("slime")}
    missing = sorted(wanted - {j[0] for j in judged})
    if p.returncode not in (0, MISS_EXIT):
        return f"{name}: exited {p.returncode}", judged
    if missing:
        return f"{name}: no judged line for {', '.join(missing)}", judged
    return ("miss" if p.returncode == MISS_EXIT else "ok"), judged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", help="benchmark names (default: all)")
    a = ap.parse_args(argv)
    tab = table()
    errors = [f"{s}: benchmark without an entry in targets.toml" for s in scripts() if s not in tab]
    errors += [f"{s}: targets.toml entry without a script" for s in tab if s not in scripts()]
    rows = []
    for name, spec in tab.items():
        if a.only and name not in a.only or name not in scripts():
            continue
        if a.quick and "quick_args" not in spec:
            print(f"--- {name}: not in bench-quick (starts real engines; `make bench` runs it)", flush=True)
            continue
        print(f"--- {name} {' '.join(spec.get('quick_args' if a.quick else 'args', []))}", flush=True)
        t0 = time.monotonic()
        status, judged = run_one(name, spec, a.quick)
        rows.append((name, status, judged, time.monotonic() - t0))
        if status not in ("ok", "miss"):
            errors.append(status)
    print("=== benchmark summary" + (" (quick: a MISS is reported, not failed)" if a.quick else ""))
    for name, status, judged, dt in rows:
        print(f"  {name:24s} {dt:6.0f} s  " + ", ".join(f"{j[0].split('.', 1)[1]} {j[1]}" for j in judged))
    misses = [j[0] for _, _, judged, _ in rows for j in judged if j[1] == "MISS"]
    if misses:
        print(f"  MISS: {', '.join(misses)}")
    for e in errors:
        print(f"  ERROR: {e}")
    return 1 if errors or (misses and not a.quick) else 0


if __name__ == "__main__":
    sys.exit(main())
