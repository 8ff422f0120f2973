"""The benchmarks' targets: one table (benchmarks/targets.toml) that every benchmark judges against.

    judge("dispatcher_scale", "req_per_s_4096", 0.97)
    -> prints "dispatcher_scale.req_per_s_4096: ratio 0.97 (target >= 0.95) PASS"
    finish() -> exit status: 0 when every judged ratio met its target, MISS_EXIT when one missed.
"""
import os
import tomllib

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets.toml")
MISS_EXIT = 3  # distinct from 1 (an exception), so `run_all.py --quick` can tell a MISS from a crash
_judged = []


def table() -> dict:
    with open(TABLE, "rb") as f:
        return tomllib.load(f)


def target(bench: str, name: str) -> tuple:
    """(op, value) of one target: op is '>=' (ours must reach it) or '<=' (ours must stay under it)."""
    t = table()[bench]["targets"][name]
    return (">=", t["min"]) if "min" in t else ("<=", t["max"])


def judge(bench: str, name: str, ratio: float) -> bool:
    op, value = target(bench, name)
    ok = ratio >= value if op == ">=" else ratio <= value
    print(f"{bench}.{name}: ratio {ratio:.3f} (target {op} {value}) {'PASS' if ok else 'MISS'}", flush=True)
    _judged.append(ok)
    return ok


def fact(bench: str, text: str) -> None:
    """A constant of the layout or setup, printed as such (never judged)."""
    print(f"{bench}: fact: {text}", flush=True)


def finish() -> int:
    if not _judged:
        raise RuntimeError("the benchmark judged nothing against benchmarks/targets.toml")
    return 0 if all(_judged) else MISS_EXIT
