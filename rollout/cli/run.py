"""`slime-moe-rollout run`: the main job.

Starts the config's engines, admits them after phased readiness, streams N prompt groups to a
trainer-side consumer that appends one fsync'd JSONL line per finished group, shows progress, prints
a summary. The prompts are a dataset (`--prompts FILE`, JSONL or Parquet, read as slime reads its prompt
data: see rollout/prompts.py), each group's line carrying the row's label and metadata, or synthetic token
ids when no file is given. An existing non-empty --output is refused unless --overwrite; `--resume OUTPUT`
continues a killed run (same run id, prompts and group ids; only the groups without a line run).
Bad input -> exit 2 with one line; an engine that cannot start -> its log tail, one line, exit 1;
every engine lost, a group missing, or more than --max-failed-fraction of samples failed -> exit 1.
A line that cannot be written (disk full, EIO) stops the rollout at once: one line naming the file and the
OS error, the engines stopped, exit 1, every line written whole. SIGINT/SIGTERM stop the engines with their
grace and exit 130/143. Either way `--resume` continues.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from rollout.cli import port, positive_int
from rollout.engines.base import BACKENDS
from rollout.prompts import synthetic as prompts_for  # noqa: F401  (r3 and the benchmarks use it)
from rollout.types import EngineEvent, SampleStatus


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="start the engines and stream a rollout to a JSONL file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="training config YAML (e.g. training_configs/tiny-cpu.yaml); not needed with --resume")
    p.add_argument("--num-groups", type=positive_int, default=None,
                   help="prompt groups to roll out (default: rollout.batch_size)")
    p.add_argument("--output", default="rollouts.jsonl", help="JSONL written by the trainer-side consumer")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output (refused otherwise)")
    p.add_argument("--resume", metavar="OUTPUT", default=None,
                   help="continue the killed run that wrote OUTPUT: run only the groups it has no line for")
    p.add_argument("--max-failed-fraction", type=_fraction, default=0.0,
                   help="exit 1 when more than this fraction of samples failed (default 0)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default="local",
                   help="engines as local child processes, or in Ray actors with placement groups")
    p.add_argument("--log-dir", default=None, help="engine logs (default: <output>.logs/)")
    p.add_argument("--seed", type=int, default=None, help="seed of the synthetic prompts (default 0)")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="prompt dataset (.jsonl, or .parquet with pyarrow); default: synthetic prompts")
    p.add_argument("--input-key", default="input", help="the prompt's key in each row (slime's --input-key)")
    p.add_argument("--label-key", default=None, help="the label's key, written with each group")
    p.add_argument("--metadata-key", default="metadata", help="optional metadata object, written with each group")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="prompts through the model tokenizer's chat template (text or a list of messages)")
    p.add_argument("--apply-chat-template-kwargs", type=_json_object, default={},
                   help="JSON object passed to apply_chat_template")
    p.add_argument("--base-port", type=port, default=None,
                   help="override rollout.base_port (engine i listens on base_port + 10*i)")
    p.add_argument("--weight-update", metavar="AFTER:CHECKPOINT", type=_weight_update, action="append", default=[],
                   help="once AFTER groups of the run are written, every engine loads CHECKPOINT (a directory) as "
                        "weight version 1, 2, ... in AFTER order; the groups in flight keep their tokens (repeatable; "
                        "recorded with the run: --resume applies them, an update already passed at start)")
    p.set_defaults(func=main)


def _fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {x:g}")
    return x


def _weight_update(text: str) -> tuple:
    after, sep, path = text.partition(":")
    if not sep or not after.isdigit() or int(after) < 1 or not path:
        raise argparse.ArgumentTypeError(f"expected AFTER:CHECKPOINT (AFTER a positive group count), got {text!r}")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a directory (a checkpoint the engines load from disk)")
    return int(after), os.path.abspath(path)


def _json_object(text: str) -> dict:
    try:
        x = json.loads(text)
    except ValueError:
        x = None
    if not isinstance(x, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return x


def _vocab(cfg, model_path: str) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    try:
        with open(os.path.join(model_path, "config.json")) as fh:
            return int(json.load(fh)["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 1000


def prompt_ids(cfg, model_path: str, dataset, n: int, seed: int, run_id: str) -> tuple:
    """The token ids of the run's prompts (the dataset's rows, else `n` synthetic ones) and, per group id,
    the row's label and metadata (written with the group)."""
    from rollout.types import group_id

    ids = [p.ids for p in dataset] if dataset else prompts_for(_vocab(cfg, model_path), n, seed)
    return ids, {group_id(run_id, i): {"label": p.label, "metadata": p.metadata} for i, p in enumerate(dataset or ())}


def main(args) -> int:
    """Arguments, the run to write (new or resumed), config and model, then the rollout itself."""
    from rollout import group_log, models, prompts
    from rollout.errors import CliError
    from training_configs.schema import load_config

    if args.config is None and not args.resume:
        raise CliError("run: --config is required (or --resume OUTPUT)")
    out_dir = os.path.dirname(os.path.abspath(args.resume or args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"--output: directory {out_dir} does not exist")
    meta = _resumed_run(args) if args.resume else None
    cfg = load_config(args.config)
    model_path = cfg.model_path(build=models.build)
    if args.base_port is not None:
        cfg.rollout.base_port = args.base_port
    source = meta.get("prompts") if meta else prompts.describe(
        args.prompts, prompts.DatasetKeys(args.input_key, args.label_key, args.metadata_key,
                                          args.apply_chat_template, args.apply_chat_template_kwargs))
    dataset = prompts.for_run(source, model_path, meta["num_groups"] if meta else args.num_groups)
    if meta is None:
        meta = {"run_id": uuid.uuid4().hex[:10], "config": os.path.abspath(args.config),
                "seed": args.seed if args.seed is not None else 0, "prompts": source,
                "num_groups": args.num_groups or (len(dataset) if dataset else cfg.rollout.batch_size),
                "weight_updates": [list(u) for u in sorted(args.weight_update)]}
        _updates_happen(args, meta["num_groups"])
        log, done = group_log.start(args.output, meta, overwrite=args.overwrite), set()
    else:
        log, resumed = group_log.resume(args.output)
        done = resumed.done
        if resumed.torn_bytes:
            print(f"note: cut a torn last line ({resumed.torn_bytes} bytes) left by the killed run; "
                  f"its group runs again", file=sys.stderr)

    try:
        if len(done) >= meta["num_groups"]:   # every id of this run has a line
            print(f"nothing to run: all {meta['num_groups']} group(s) of run {meta['run_id']} have a line in "
                  f"{args.output}", file=sys.stderr)
            return 0
        return asyncio.run(_run(cfg, model_path, meta, done, log, args, dataset))
    finally:
        log.close()


def _updates_happen(args, to_write: int) -> None:
    """Each --weight-update comes before the run's last group (else it would never happen)."""
    from rollout.errors import CliError

    late = [a for a, _ in args.weight_update if a >= to_write]
    if late:
        raise CliError(f"--weight-update {late[0]}:...: after {late[0]} group(s), but this run writes {to_write}; "
                       f"the update would never happen")


def _resumed_run(args) -> dict:
    """`--resume OUTPUT`: the run's recorded config, group count and seed (a differing flag is refused)."""
    from rollout import group_log
    from rollout.errors import CliError

    meta = group_log.read_meta(args.resume)
    for flag, given, recorded in (("--config", args.config and os.path.abspath(args.config), meta["config"]),
                                  ("--num-groups", args.num_groups, meta["num_groups"]),
                                  ("--seed", args.seed, meta["seed"]),
                                  ("--prompts", args.prompts and os.path.abspath(args.prompts),
                                   (meta.get("prompts") or {}).get("path"))):
        if given is not None and given != recorded:
            raise CliError(f"{flag} {given} differs from the run being resumed ({recorded}); drop it")
    recorded = [tuple(u) for u in meta["weight_updates"]]
    if args.weight_update and sorted(args.weight_update) != recorded:
        said = " ".join(f"{a}:{p}" for a, p in recorded) or "none"
        raise CliError(f"--weight-update differs from the run being resumed ({said}); drop it: the recorded "
                       f"updates apply")
    args.config, args.num_groups, args.seed, args.output = meta["config"], meta["num_groups"], meta["seed"], args.resume
    gone = [path for _, path in recorded if not os.path.isdir(path)]
    if gone:
        raise CliError(f"--resume: the run's weight-update checkpoint {gone[0]} is not a directory any more")
    args.weight_update = recorded
    return meta


async def _run(cfg, model_path: str, meta: dict, done: set, log, args, dataset=None) -> int:
    """Engines up, the groups without a line rolled out, one fsync'd line per finished group, the verdict."""
    from rollout.cli.console import progress_bar, say, start_failure, stderr_console
    from rollout.engines.base import EngineStartError, open_backend
    from rollout.engines.readiness import ReadinessError, RichView
    from rollout.errors import EnginesLost, one_line
    from rollout.group_log import WriteError
    from rollout.manager import RolloutManager, group_record
    from rollout.stream import GroupStream, pump
    from rollout.types import Group, group_id
    from rollout.versions import StaleGate

    console = stderr_console()
    progress = progress_bar(console)
    n, run_id = meta["num_groups"], meta["run_id"]
    prompts, extra = prompt_ids(cfg, model_path, dataset, n, meta["seed"], run_id)
    backend = open_backend(args.backend, args.log_dir or os.path.abspath(args.output) + ".logs")
    mgr = RolloutManager.from_config(cfg, backend, model_path, view=RichView(progress), run_id=run_id)
    todo = [Group.fresh(group_id(run_id, i), p, mgr.n_samples) for i, p in enumerate(prompts)
            if group_id(run_id, i) not in done]
    stream = GroupStream(maxsize=4)   # backpressure: finished groups wait while the writer is behind
    tally = Tally(gate=StaleGate(stream, cfg.rollout.max_weight_version_lag, cfg.rollout.stale_groups,
                                 lambda: mgr.weight_version))
    t0 = time.monotonic()
    result, lost = None, None
    stopped = _stop_on_signals(asyncio.current_task())
    resume_hint = f"continue with: slime-moe-rollout run --resume {args.output}"
    ended = None   # (line, exit status) of a run that stopped early

    # (after groups of the run, checkpoint, version); a resumed run starts on the last one already passed
    updates = [(a, path, str(i + 1)) for i, (a, path) in enumerate(sorted(args.weight_update))]
    passed = [u for u in updates if u[0] <= len(done)][-1:]
    updates = [u for u in updates if u[0] > len(done)]

    async def update(after, path, version):
        t = time.monotonic()
        try:
            await mgr.update_weights_from_disk(path, version)
        except Exception as e:
            raise WeightUpdateFailed(f"weight update {version} ({path}, after {after} groups) failed: "
                                     f"{one_line(e)}") from None
        tally.updates.append((after, version, time.monotonic() - t))

    async def write(group):  # the trainer side: one fsync'd line per group, as it finishes
        await asyncio.to_thread(log.append, {**group_record(group), **extra.get(group.group_id, {})})
        tally.add(group)
        progress.advance(bar)
        while updates and len(done) + log.lines >= updates[0][0]:   # the groups in flight wait, paused, then resume
            await update(*updates.pop(0))

    with progress:
        try:
            try:
                await mgr.start()
            except (ReadinessError, EngineStartError) as e:
                progress.stop()
                return start_failure(console, e)
            t_ready = time.monotonic() - t0
            for u in passed:   # the weights the killed run had reached, before any group of this one
                await update(*u)
            bar = progress.add_task("rollout groups", total=n, completed=n - len(todo))
            result = await pump(mgr.rollout(todo, tally.gate, batch_size=len(todo), refill=tally.gate.refill), stream,
                                write)
        except EnginesLost as e:
            lost = e
        except (WriteError, WeightUpdateFailed) as e:
            ended = f"error: {e}; once that is fixed, {resume_hint}", 1
        except asyncio.CancelledError:
            if not stopped:
                raise
            ended = (f"stopped by {signal.Signals(stopped[0]).name}: {len(done) + log.lines} of {n} group(s) in "
                     f"{args.output}, engines stopped; {resume_hint}", 128 + stopped[0])
        finally:
            await mgr.stop()
    if ended:
        say(console, ended[0])
        return ended[1]
    return tally.verdict(console, mgr, result, lost, meta, len(done) + log.lines, args, t_ready,
                         time.monotonic() - t0)


def _stop_on_signals(task) -> list:
    """SIGINT/SIGTERM cancel `task` once (it then stops the engines with their grace); the returned list
    gets the signal number."""
    got: list = []
    loop = asyncio.get_running_loop()

    def on_signal(signum):
        if not got:
            got.append(signum)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return got


class WeightUpdateFailed(RuntimeError):
    """A --weight-update did not apply on every engine: the run stops (its engines were resumed)."""


# ---------------------------------------------------------------- what `run` prints at the end, its exit status

@dataclass
class Tally:
    """What the trainer-side consumer wrote, counted; `verdict` prints the summary table and any `error:` line,
    and returns 1 when groups are missing, every engine was lost, or more than --max-failed-fraction failed."""
    samples: int = 0
    failed: int = 0
    tokens: int = 0
    per_engine: dict = field(default_factory=dict)   # engine -> samples finished there
    reasons: dict = field(default_factory=dict)      # error text -> samples that failed with it
    updates: list = field(default_factory=list)      # (after groups, version, seconds) of each --weight-update
    gate: object = None                               # versions.StaleGate: rollout.max_weight_version_lag

    def add(self, group) -> None:
        for s in group.samples:
            self.samples += 1
            self.tokens += len(s.response_ids)
            if s.status is SampleStatus.FAILED:
                self.failed += 1
                self.reasons[s.error] = self.reasons.get(s.error, 0) + 1
            self.per_engine[s.engine] = self.per_engine.get(s.engine, 0) + 1

    def verdict(self, console, mgr, result, lost, meta: dict, written: int, args, t_ready: float,
                wall: float) -> int:
        """The summary, then the exit status: 1 when groups are missing or too many samples failed."""
        from rollout.cli.console import say

        n = meta["num_groups"]
        if result is not None:
            self._summary(console, mgr, result, n, written, t_ready, wall, args.output, meta["run_id"])
        written += self.gate.stale["drop"] if self.gate else 0   # a dropped stale group has no line, by design
        if lost is not None:
            say(console, f"error: {lost}")
        elif written < n:
            say(console, f"error: {n - written} of {n} group(s) have no line in {args.output}")
        frac = self.failed / max(self.samples, 1)
        if self.failed and frac > args.max_failed_fraction:
            reason, k = max(self.reasons.items(), key=lambda kv: kv[1])
            say(console, f"error: {self.failed} of {self.samples} samples failed ({frac:.1%} > "
                         f"--max-failed-fraction {args.max_failed_fraction:g}); most common: {reason} (x{k})")
            return 1
        if lost is not None or written < n:
            say(console, f"continue with: slime-moe-rollout run --resume {args.output}")
            return 1
        return 0

    def _summary(self, console, mgr, result, n, written, t_ready, wall, output, run_id) -> None:
        from rich.table import Table

        t = Table(title=f"rollout summary (run {run_id})", show_header=False)
        why = "; ".join(f"{r} (x{k})" for r, k in sorted(self.reasons.items(), key=lambda kv: -kv[1])[:3])
        restart_failures = sum(getattr(mgr.source, "restart_failures", {}).values())   # attached: none
        rows = [
            ("groups written", f"{written} / {n} ({result.delivered} in this run)"),
            ("samples", f"{self.samples} ({self.failed} failed{': ' + why if why else ''})"),
            ("response tokens", str(self.tokens)),
            ("engines ready after", f"{t_ready:.1f} s"),
            ("first group after", f"{result.first_group_s:.2f} s of rollout" if result.first_group_s else "-"),
            ("rollout time", f"{result.wall_s:.2f} s ({self.tokens / max(result.wall_s, 1e-9):.1f} tokens/s)"),
            ("re-sent requests", f"{result.resent} (+{result.unrouted_aborts} queued aborts resumed)"),
            ("samples per engine", ", ".join(f"{k}: {v}" for k, v in sorted(self.per_engine.items())) or "-"),
            ("engine deaths / restarts", f"{mgr.count(EngineEvent.DEAD)} / {mgr.count(EngineEvent.READMITTED)}"
                                         f" ({restart_failures} failed restarts)"),
            ("stale groups", f"{self.gate.line()} (rollout.max_weight_version_lag {self.gate.lag})"
                             if self.gate and self.gate.lag is not None else "-"),
            ("weight updates", ", ".join(f"{v} after {a} groups ({t:.1f} s)" for a, v, t in self.updates) or "-"),
            ("total time", f"{wall:.1f} s"),
            ("output", output),
        ]
        for k, v in rows:
            t.add_row(k, v)
        console.print(t)
