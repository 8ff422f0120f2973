"""`slime-moe-rollout serve`: managed-engines mode - start the config's engines and keep them up.

Starts every engine with the rollout manager (phased readiness, progress on stderr), then prints the
engines' `host:port` list on stdout (pass it to slime's `--rollout-external-engine-addrs`): where each
engine's node 0 really serves, in config order (the local backend gives what `config render --format
external-addrs` prints; with `--backend ray` node 0 may be another host), and a ready line on stderr. It then supervises the
engines with the manager's health monitor (a dead engine is restarted and re-admitted after full
readiness) until SIGINT/SIGTERM, stops every engine and exits 0.
slime (managed mode): engines run keyless (`rollout.engine_auth: none`: slime sends no key) on
`rollout.host`; `config check`'s slime checks run before any engine starts; a restarted engine whose
weight_version differs from its peers' stays paused (`serve_weights`).
`--control-port P` adds serve's own HTTP API on rollout.host, listening before the addresses are printed:
`POST /update_weights` (every engine loads a checkpoint, its requests kept in flight) and, with `--num-groups N` /
`--prompts FILE`, `GET /groups`: serve rolls those prompts out and hands each finished group to the consumer once
(`serve_stream`).
Bad input -> exit 2 with one line; an engine that cannot start -> its log tail, one line, exit 1;
every engine given up after its restarts -> exit 1.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

from rollout.cli import port, positive_int
from rollout.cli.console import say as _say
from rollout.engines.base import BACKENDS
from rollout.types import EngineEvent


def add_parser(sub) -> None:
    from training_configs.server_args import PORTS_PER_ENGINE

    p = sub.add_parser("serve", help="start the engines and keep them up for slime to attach (managed mode)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training config YAML (e.g. training_configs/tiny-cpu.yaml)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default="local",
                   help="engines as local child processes, or in Ray actors with placement groups")
    p.add_argument("--log-dir", default="serve.logs", help="engine logs (default: ./serve.logs)")
    p.add_argument("--base-port", type=port, default=None,
                   help=f"override rollout.base_port (engine i listens on base_port + {PORTS_PER_ENGINE} i)")
    p.add_argument("--control-port", type=port, default=None,
                   help="serve's own HTTP API on rollout.host: POST /update_weights, GET /groups (docs/manager.md)")
    p.add_argument("--num-groups", type=positive_int, default=None,
                   help="also roll out N prompt groups (synthetic, or the first N of --prompts), read on GET /groups")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="prompt dataset (.jsonl or .parquet, read as `run` reads it) rolled out for GET /groups")
    p.set_defaults(func=main)


def main(args) -> int:
    from rollout import config as rconfig
    from rollout import prompts
    from rollout.cli import CliError
    from rollout.cli.engine import model_for

    cfg = rconfig.load(args.config)
    if args.base_port is not None:
        cfg.rollout.base_port = args.base_port
    if os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        raise CliError(f"--log-dir: {args.log_dir} exists and is not a directory")
    if cfg.slime.integration == "managed":   # what slime will refuse, before any engine starts
        from training_configs.slime_check import managed_checks
        managed_checks(cfg)
    if (args.num_groups or args.prompts) and args.control_port is None:
        raise CliError("--num-groups / --prompts: give --control-port too (the consumer reads the groups there)")
    if args.control_port is not None:
        _free(cfg.rollout.host, args.control_port)
    model_path = model_for(cfg)
    args.dataset = prompts.for_run(prompts.describe(args.prompts, prompts.DatasetKeys()), model_path, args.num_groups)
    return asyncio.run(_serve(cfg, model_path, args))


def _free(host: str, port: int) -> None:
    """--control-port must bind on rollout.host before any engine starts."""
    import socket

    from rollout.cli import CliError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CliError(f"--control-port {port}: cannot bind {host}:{port} ({e.strerror or e})") from None


def _write_key(log_dir: str, key: str) -> str:
    from rollout.net import write_private

    os.makedirs(log_dir, exist_ok=True)
    return write_private(os.path.join(os.path.abspath(log_dir), "api_key"), key + "\n")


async def _serve(cfg, model_path: str, args) -> int:
    from rollout.cli.console import progress_bar, start_failure, stderr_console
    from rollout.engines.base import EngineStartError, open_backend
    from rollout.engines.client import EngineClient
    from rollout.engines.readiness import LineView, ReadinessError, RichView
    from rollout.manager import RolloutManager
    from rollout.cli.serve_weights import WeightGuard
    from training_configs.slime_check import managed_checks

    console = stderr_console()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    progress = progress_bar(console)
    client = EngineClient()
    guard = WeightGuard(client, cfg.rollout.restart_checkpoint, lambda text: _say(console, text))
    mgr = RolloutManager.from_config(cfg, open_backend(args.backend, args.log_dir), model_path, client=client,
                                     view=RichView(progress), weight_sync_hook=guard.hook,
                                     restart_view=LineView(lambda text: _say(console, text)))  # a line per phase
    fleet = mgr.source
    t0 = time.monotonic()
    with progress:
        starting = asyncio.create_task(mgr.start())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not starting.done():          # a signal during start-up: stop what was started
            starting.cancel()
            try:
                await starting
            except BaseException:
                pass
            progress.stop()
            _say(console, "interrupted during start-up; stopping the engines")
            await mgr.stop()
            return 0
        err = starting.exception()
        if err is not None:              # start() already stopped every engine
            progress.stop()
            if not isinstance(err, (ReadinessError, EngineStartError)):
                raise err
            return start_failure(console, err)
    tracker = asyncio.create_task(guard.track(mgr))
    try:   # serve's own API listens before the addresses are printed
        control = await _control(cfg, model_path, args, mgr, console) if args.control_port else None
    except OSError as e:   # the port was taken since main() checked it
        _say(console, f"error: --control-port {args.control_port}: {e.strerror or e}; stopping the engines")
        tracker.cancel()
        await mgr.stop()
        return 1
    addrs = served_addrs(fleet)
    print(addrs, flush=True)
    if cfg.rollout.engine_auth == "none":
        key_note = f"no API key, bound to {cfg.rollout.host}"
        for w in managed_checks(cfg):
            _say(console, f"WARNING: {w}")
    elif cfg.rollout.api_key:
        key_note = "api key from rollout.api_key"
    else:
        key = next(iter(fleet.specs.values())).api_key
        key_note = f"generated api key in {_write_key(args.log_dir, key)}"
    _say(console, f"ready: {len(fleet.specs)} engine(s) up after {time.monotonic() - t0:.1f} s ({key_note}); "
                  f"slime: --rollout-external-engine-addrs {addrs}; "
                  f"supervising until SIGINT/SIGTERM")
    try:
        return await _supervise(mgr, stop, console, control)
    finally:
        tracker.cancel()


async def _control(cfg, model_path: str, args, mgr, console):
    """serve's own API (and its rollout, with --num-groups / --prompts): rollout/cli/serve_stream.py."""
    from rollout.cli.run import prompt_ids
    from rollout.cli.serve_stream import Control

    ids, extra = None, {}
    if args.num_groups or args.dataset:
        ids, extra = prompt_ids(cfg, model_path, args.dataset, args.num_groups or len(args.dataset), 0, mgr.run_id)
    key = None if cfg.rollout.engine_auth == "none" else next(iter(mgr.source.specs.values())).api_key
    return await Control.open(mgr, cfg, args, ids, extra, key, lambda text: _say(console, text))


def served_addrs(fleet) -> str:
    """`host:port` of every engine's HTTP server (node 0), in config order."""
    return " ".join(fleet.engines[name].url.split("://", 1)[-1].rstrip("/") for name in fleet.specs)


async def _supervise(mgr, stop: asyncio.Event, console, control=None) -> int:
    """Report the manager's events (deaths, restarts) until a signal or until every engine is given up;
    then `control` (serve's API and rollout) is closed and the engines are stopped."""
    seen, rc = (mgr.events[-1].seq + 1 if mgr.events else 0), 0
    try:
        while not stop.is_set() and rc == 0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            for ev in mgr.events_since(seen):
                seen = ev.seq + 1
                if ev.kind == EngineEvent.ALL_LOST:   # the manager's verdict: nothing left to supervise
                    print(f"error: {ev.detail}", file=sys.stderr)
                    rc = 1
                else:
                    _say(console, f"{ev.engine}: {ev}")
    finally:
        if control is not None:
            await control.close()
        _say(console, "stopping the engines")
        await mgr.stop()
    if rc == 0:
        _say(console, "stopped")
    return rc
