"""`slime-moe-rollout run`: the main job.

Starts the config's engines, admits them after phased readiness, streams N prompt groups to a
trainer-side consumer that appends one fsync'd JSONL line per finished group, shows progress, prints
a summary. An existing non-empty --output is refused unless --overwrite; `--resume OUTPUT` continues a
killed run (same run id, prompts and group ids; only the groups without a line run).
Bad input -> exit 2 with one line; an engine that cannot start -> its log tail, one line, exit 1;
every engine lost, a group missing, or more than --max-failed-fraction of samples failed -> exit 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
import uuid


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="start the engines and stream a rollout to a JSONL file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="training config YAML (e.g. training_configs/tiny-cpu.yaml); not needed with --resume")
    p.add_argument("--num-groups", type=_positive, default=None,
                   help="prompt groups to roll out (default: rollout.batch_size)")
    p.add_argument("--output", default="rollouts.jsonl", help="JSONL written by the trainer-side consumer")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output (refused otherwise)")
    p.add_argument("--resume", metavar="OUTPUT", default=None,
                   help="continue the killed run that wrote OUTPUT: run only the groups it has no line for")
    p.add_argument("--max-failed-fraction", type=_fraction, default=0.0,
                   help="exit 1 when more than this fraction of samples failed (default 0)")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="engines as local child processes, or in Ray actors with placement groups")
    p.add_argument("--log-dir", default=None, help="engine logs (default: <output>.logs/)")
    p.add_argument("--seed", type=int, default=None, help="seed of the synthetic prompts (default 0)")
    p.add_argument("--base-port", type=int, default=None,
                   help="override rollout.base_port (engine i listens on base_port + 10*i)")
    p.set_defaults(func=main)


def _fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {x:g}")
    return x


def prompts_for(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Synthetic prompts: 8-24 random token ids, avoiding the first special ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))] for _ in range(n)]


def _vocab(cfg, model_path: str) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    try:
        with open(os.path.join(model_path, "config.json")) as fh:
            return int(json.load(fh)["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 1000


def main(args) -> int:
    from rollout import config as rconfig
    from rollout import group_log
    from rollout.cli import CliError
    from rollout.cli.engine import model_for

    meta = _resumed_run(args) if args.resume else None
    if args.config is None:
        raise CliError("run: --config is required (or --resume OUTPUT)")
    try:
        cfg = rconfig.load(args.config)
        model_path = model_for(cfg)
    except rconfig.ConfigError as e:
        raise CliError(str(e)) from None
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"--output: directory {out_dir} does not exist")
    if args.base_port is not None:
        if not 1024 <= args.base_port <= 65000:
            raise CliError(f"--base-port: must be in [1024, 65000], got {args.base_port}")
        cfg.rollout.base_port = args.base_port
    n = args.num_groups or cfg.rollout.batch_size
    log_dir = args.log_dir or os.path.abspath(args.output) + ".logs"
    if meta is None:
        meta = {"run_id": uuid.uuid4().hex[:10], "config": os.path.abspath(args.config),
                "seed": args.seed if args.seed is not None else 0, "num_groups": n}
        log, done = group_log.start(args.output, meta, overwrite=args.overwrite), set()
    else:
        log, resumed = group_log.resume(args.output)
        done = resumed.done
        if resumed.torn_bytes:
            print(f"note: cut a torn last line ({resumed.torn_bytes} bytes) left by the killed run; "
                  f"its group runs again", file=sys.stderr)

    def _term(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the engines are stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        return asyncio.run(_run(cfg, model_path, meta, done, log, args, log_dir))
    finally:
        log.close()


def _resumed_run(args) -> dict:
    """`--resume OUTPUT`: the run's recorded config, group count and seed (a differing flag is refused)."""
    from rollout import group_log
    from rollout.cli import CliError

    meta = group_log.read_meta(args.resume)
    for flag, given, recorded in (("--config", args.config and os.path.abspath(args.config), meta["config"]),
                                  ("--num-groups", args.num_groups, meta["num_groups"]),
                                  ("--seed", args.seed, meta["seed"])):
        if given is not None and given != recorded:
            raise CliError(f"{flag} {given} differs from the run being resumed ({recorded}); drop it")
    args.config, args.num_groups, args.seed, args.output = meta["config"], meta["num_groups"], meta["seed"], args.resume
    return meta


def _backend(kind: str, log_dir: str, cfg):
    if kind == "ray":
        from rollout.engines.ray_backend import RayBackend
        # RAY_ADDRESS set: join that cluster as it is; else a local one sized to this machine
        init = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(2, os.cpu_count() or 2)}
        return RayBackend(log_dir, cpus_per_engine=1, init_kwargs=init)
    from rollout.engines.local_backend import LocalBackend
    return LocalBackend(log_dir)


async def _run(cfg, model_path: str, meta: dict, done: set, log, args, log_dir: str) -> int:
    from rollout.cli.console import progress_bar, say, start_failure, stderr_console
    from rollout.engines.base import EngineStartError
    from rollout.engines.readiness import ReadinessError, RichView
    from rollout.manager import EnginesLost, RolloutManager, group_record
    from rollout.states import SampleStatus
    from rollout.stream import GroupStream

    console = stderr_console()
    progress = progress_bar(console)
    backend = _backend(args.backend, log_dir, cfg)
    mgr = RolloutManager.from_config(cfg, backend, model_path, view=RichView(progress), run_id=meta["run_id"])
    n = meta["num_groups"]
    prompts = prompts_for(_vocab(cfg, model_path), n, meta["seed"])
    todo = [g for g in (mgr.new_group(p, index=i) for i, p in enumerate(prompts)) if g.group_id not in done]
    if not todo:
        say(console, f"nothing to run: all {n} group(s) of run {meta['run_id']} have a line in {args.output}")
        return 0
    stream = GroupStream(maxsize=max(4, len(todo)))
    records = {"samples": 0, "failed": 0, "tokens": 0, "per_engine": {}, "reasons": {}}
    t0 = time.monotonic()
    result, lost = None, None
    with progress:
        try:
            await mgr.start()
        except (ReadinessError, EngineStartError) as e:
            progress.stop()
            return start_failure(console, e)
        t_ready = time.monotonic() - t0
        bar = progress.add_task("rollout groups", total=n, completed=n - len(todo))

        async def consume():
            async for group in stream:  # the trainer side: one fsync'd line per group, as it finishes
                rec = group_record(group)
                await asyncio.to_thread(log.append, rec)
                for s in group.samples:
                    records["samples"] += 1
                    records["tokens"] += len(s.response_ids)
                    if s.status == SampleStatus.FAILED:
                        records["failed"] += 1
                        records["reasons"][s.error] = records["reasons"].get(s.error, 0) + 1
                    per = records["per_engine"]
                    per[s.engine] = per.get(s.engine, 0) + 1
                progress.advance(bar)

        consumer = asyncio.create_task(consume())
        try:
            result = await mgr.rollout(todo, stream, batch_size=len(todo))
        except EnginesLost as e:
            lost = e
        finally:
            await stream.close()
            await consumer
            await mgr.stop()
    written = len(done) + log.lines
    return _verdict(console, mgr, result, lost, records, meta, written, args, t_ready, time.monotonic() - t0)


def _verdict(console, mgr, result, lost, records, meta, written, args, t_ready, wall) -> int:
    """The summary, then the exit status: 1 when groups are missing or too many samples failed."""
    from rollout.cli.console import say

    n = meta["num_groups"]
    if result is not None:
        _summary(console, mgr, result, records, n, written, t_ready, wall, args.output, meta["run_id"])
    if lost is not None:
        say(console, f"error: {lost}")
    elif written < n:
        say(console, f"error: {n - written} of {n} group(s) have no line in {args.output}")
    frac = records["failed"] / max(records["samples"], 1)
    if records["failed"] and frac > args.max_failed_fraction:
        reason, k = max(records["reasons"].items(), key=lambda kv: kv[1])
        say(console, f"error: {records['failed']} of {records['samples']} samples failed ({frac:.1%} > "
                     f"--max-failed-fraction {args.max_failed_fraction:g}); most common: {reason} (x{k})")
        return 1
    if lost is not None or written < n:
        say(console, f"continue with: slime-moe-rollout run --resume {args.output}")
        return 1
    return 0


def _summary(console, mgr, result, records, n, written, t_ready, wall, output, run_id) -> None:
    from rich.table import Table

    from rollout.states import EngineEvent

    t = Table(title=f"rollout summary (run {run_id})", show_header=False)
    per = records["per_engine"]
    why = "; ".join(f"{r} (x{k})" for r, k in sorted(records["reasons"].items(), key=lambda kv: -kv[1])[:3])
    rows = [
        ("groups written", f"{written} / {n} ({result.delivered} in this run)"),
        ("samples", f"{records['samples']} ({records['failed']} failed{': ' + why if why else ''})"),
        ("response tokens", str(records["tokens"])),
        ("engines ready after", f"{t_ready:.1f} s"),
        ("first group after", f"{result.first_group_s:.2f} s of rollout" if result.first_group_s else "-"),
        ("rollout time", f"{result.wall_s:.2f} s ({records['tokens'] / max(result.wall_s, 1e-9):.1f} tokens/s)"),
        ("re-sent requests", f"{result.resent} (+{result.unrouted_aborts} queued aborts resumed)"),
        ("samples per engine", ", ".join(f"{k}: {v}" for k, v in sorted(per.items())) or "-"),
        ("engine deaths / restarts", f"{mgr.count(EngineEvent.DEAD)} / {mgr.count(EngineEvent.READMITTED)}"
                                     f" ({sum(mgr.restart_failures.values())} failed restarts)"),
        ("total time", f"{wall:.1f} s"),
        ("output", output),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
