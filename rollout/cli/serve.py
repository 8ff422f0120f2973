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

from rollout.cli import port
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
    p.set_defaults(func=main)


def main(args) -> int:
    from rollout import config as rconfig
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
    model_path = model_for(cfg)
    return asyncio.run(_serve(cfg, model_path, args))


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
    tracker = asyncio.create_task(guard.track(mgr))
    try:
        return await _supervise(mgr, stop, console)
    finally:
        tracker.cancel()


def served_addrs(fleet) -> str:
    """`host:port` of every engine's HTTP server (node 0), in config order."""
    return " ".join(fleet.engines[name].url.split("://", 1)[-1].rstrip("/") for name in fleet.specs)


async def _supervise(mgr, stop: asyncio.Event, console) -> int:
    """Report the manager's events (deaths, restarts) until a signal or until every engine is given up."""
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
        _say(console, "stopping the engines")
        await mgr.stop()
    if rc == 0:
        _say(console, "stopped")
    return rc
