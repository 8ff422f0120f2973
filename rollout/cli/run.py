"""`slime-moe-rollout run`: the main job.

Starts the config's engines, admits them after phased readiness, streams N prompt groups to a
trainer-side consumer that writes one JSONL line per finished group, shows progress, prints a summary.
Bad input -> exit 2 with one line; an engine that cannot start -> its log tail, one line, exit 1.
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
    p.add_argument("--config", required=True, help="training config YAML (e.g. training_configs/tiny-cpu.yaml)")
    p.add_argument("--num-groups", type=_positive, default=None,
                   help="prompt groups to roll out (default: rollout.batch_size)")
    p.add_argument("--output", default="rollouts.jsonl", help="JSONL written by the trainer-side consumer")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="engines as local child processes, or in Ray actors with placement groups")
    p.add_argument("--log-dir", default=None, help="engine logs (default: <output>.logs/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    p.add_argument("--base-port", type=int, default=None,
                   help="override rollout.base_port (engine i listens on base_port + 10*i)")
    p.set_defaults(func=main)


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
    from rollout.cli import CliError
    from rollout import config as rconfig

    try:
        cfg = rconfig.load(args.config)
        model_path = rconfig.resolve_model(cfg)
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

    def _term(signum, frame):  # SIGTERM: unwind like Ctrl-C, so the engines are stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    return asyncio.run(_run(cfg, model_path, n, args, log_dir))


def _backend(kind: str, log_dir: str, cfg):
    if kind == "ray":
        from rollout.engines.ray_backend import RayBackend
        # RAY_ADDRESS set: join that cluster as it is; else a local one sized to this machine
        init = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(2, os.cpu_count() or 2)}
        return RayBackend(log_dir, cpus_per_engine=1, init_kwargs=init)
    from rollout.engines.lifecycle import LocalBackend
    return LocalBackend(log_dir)


async def _run(cfg, model_path: str, n: int, args, log_dir: str) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rollout.engines.lifecycle import EngineStartError
    from rollout.manager import RolloutManager, group_record
    from rollout.engines.readiness import ReadinessError, RichView
    from rollout.stream import GroupStream

    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console)
    backend = _backend(args.backend, log_dir, cfg)
    mgr = RolloutManager.from_config(cfg, backend, model_path, view=RichView(progress))
    stream = GroupStream(maxsize=max(4, n))
    prompts = prompts_for(_vocab(cfg, model_path), n, args.seed)
    records = {"samples": 0, "failed": 0, "tokens": 0, "per_engine": {}}
    t0 = time.monotonic()
    with progress:
        try:
            await mgr.start()
        except (ReadinessError, EngineStartError) as e:
            progress.stop()
            for line in getattr(e, "log_tail", [])[-15:]:
                console.print(f"  | {line}", markup=False, highlight=False)
            print(f"error: {e}", file=sys.stderr)
            return 1
        t_ready = time.monotonic() - t0
        bar = progress.add_task("rollout groups", total=n)
        try:
            with open(args.output, "w") as fh:
                async def consume():
                    async for group in stream:  # the trainer side: one line per group, as it finishes
                        rec = group_record(group)
                        fh.write(json.dumps(rec) + "\n")
                        fh.flush()
                        for s in rec["samples"]:
                            records["samples"] += 1
                            records["failed"] += s["status"] == "failed"
                            records["tokens"] += s["response_len"]
                            per = records["per_engine"]
                            per[s["engine"]] = per.get(s["engine"], 0) + 1
                        progress.advance(bar)

                consumer = asyncio.create_task(consume())
                result = await mgr.rollout(prompts, stream, batch_size=n)
                await stream.close()
                await consumer
        finally:
            await mgr.stop()
    _summary(console, mgr, result, records, n, t_ready, time.monotonic() - t0, args.output)
    return 0 if result.delivered == n else 1


def _summary(console, mgr, result, records, n, t_ready, wall, output) -> None:
    from rich.table import Table

    t = Table(title="rollout summary", show_header=False)
    per = records["per_engine"]
    rows = [
        ("groups delivered", f"{result.delivered} / {n}"),
        ("samples", f"{records['samples']} ({records['failed']} failed)"),
        ("response tokens", str(records["tokens"])),
        ("engines ready after", f"{t_ready:.1f} s"),
        ("first group after", f"{result.first_group_s:.2f} s of rollout" if result.first_group_s else "-"),
        ("rollout time", f"{result.wall_s:.2f} s ({records['tokens'] / max(result.wall_s, 1e-9):.1f} tokens/s)"),
        ("re-sent requests", str(result.resent)),
        ("samples per engine", ", ".join(f"{k}: {v}" for k, v in sorted(per.items())) or "-"),
        ("engine deaths / restarts", f"{sum(w.startswith('dead') for _, _, w in mgr.events)} / "
                                     f"{sum('re-admitted' in w for _, _, w in mgr.events)}"),
        ("total time", f"{wall:.1f} s"),
        ("output", output),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
