"""What `run` prints when the rollout ends, and its exit status.

`Tally` counts what the trainer-side consumer wrote; `verdict` prints the summary table and any
`error:` line, and returns 1 when groups are missing, every engine was lost, or more than
--max-failed-fraction of the samples failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout.types import EngineEvent, SampleStatus


@dataclass
class Tally:
    samples: int = 0
    failed: int = 0
    tokens: int = 0
    per_engine: dict = field(default_factory=dict)   # engine -> samples finished there
    reasons: dict = field(default_factory=dict)      # error text -> samples that failed with it

    def add(self, group) -> None:
        for s in group.samples:
            self.samples += 1
            self.tokens += len(s.response_ids)
            if s.status is SampleStatus.FAILED:
                self.failed += 1
                self.reasons[s.error] = self.reasons.get(s.error, 0) + 1
            self.per_engine[s.engine] = self.per_engine.get(s.engine, 0) + 1


def verdict(console, mgr, result, lost, tally: Tally, meta: dict, written: int, args, t_ready: float,
            wall: float) -> int:
    """The summary, then the exit status: 1 when groups are missing or too many samples failed."""
    from rollout.cli.console import say

    n = meta["num_groups"]
    if result is not None:
        _summary(console, mgr, result, tally, n, written, t_ready, wall, args.output, meta["run_id"])
    if lost is not None:
        say(console, f"error: {lost}")
    elif written < n:
        say(console, f"error: {n - written} of {n} group(s) have no line in {args.output}")
    frac = tally.failed / max(tally.samples, 1)
    if tally.failed and frac > args.max_failed_fraction:
        reason, k = max(tally.reasons.items(), key=lambda kv: kv[1])
        say(console, f"error: {tally.failed} of {tally.samples} samples failed ({frac:.1%} > "
                     f"--max-failed-fraction {args.max_failed_fraction:g}); most common: {reason} (x{k})")
        return 1
    if lost is not None or written < n:
        say(console, f"continue with: slime-moe-rollout run --resume {args.output}")
        return 1
    return 0


def _summary(console, mgr, result, tally: Tally, n, written, t_ready, wall, output, run_id) -> None:
    from rich.table import Table

    t = Table(title=f"rollout summary (run {run_id})", show_header=False)
    why = "; ".join(f"{r} (x{k})" for r, k in sorted(tally.reasons.items(), key=lambda kv: -kv[1])[:3])
    rows = [
        ("groups written", f"{written} / {n} ({result.delivered} in this run)"),
        ("samples", f"{tally.samples} ({tally.failed} failed{': ' + why if why else ''})"),
        ("response tokens", str(tally.tokens)),
        ("engines ready after", f"{t_ready:.1f} s"),
        ("first group after", f"{result.first_group_s:.2f} s of rollout" if result.first_group_s else "-"),
        ("rollout time", f"{result.wall_s:.2f} s ({tally.tokens / max(result.wall_s, 1e-9):.1f} tokens/s)"),
        ("re-sent requests", f"{result.resent} (+{result.unrouted_aborts} queued aborts resumed)"),
        ("samples per engine", ", ".join(f"{k}: {v}" for k, v in sorted(tally.per_engine.items())) or "-"),
        ("engine deaths / restarts", f"{mgr.count(EngineEvent.DEAD)} / {mgr.count(EngineEvent.READMITTED)}"
                                     f" ({sum(mgr.source.restart_failures.values())} failed restarts)"),
        ("total time", f"{wall:.1f} s"),
        ("output", output),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
