"""What the run / serve / engine commands print at start-up and on failure, in one place.

Progress goes to stderr (rich); a start-up failure prints the engine's last log lines, indented
with `  | `, then one `error: ...` line, and the command exits 1.
"""
from __future__ import annotations

import sys

LOG_TAIL_LINES = 15


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def progress_bar(console):
    """The progress display of engine start-up (one row per engine) and of the rollout."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console)


def say(console, text: str) -> None:
    """One plain line on stderr (no rich markup, no wrapping)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def start_failure(console, err: BaseException, log_tail: list[str] | None = None) -> int:
    """An engine that could not start: its log tail, then one `error:` line; returns the exit status 1.
    `log_tail`: lines (default: the error's own `.log_tail`, as a ReadinessError carries)."""
    lines = log_tail if log_tail is not None else getattr(err, "log_tail", None) or []
    for line in lines[-LOG_TAIL_LINES:]:
        say(console, f"  | {line}")
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    print(f"error: {first}", file=sys.stderr, flush=True)
    return 1
