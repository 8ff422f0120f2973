"""The rollout's errors and their one-line texts, low in the house (every layer may raise them).

Which to catch: `CliError` is bad input (one line, exit 2, nothing retried); `EngineLost` is one
attempt's engine going away (the dispatcher re-sends the sample elsewhere); `EnginesLost` means no
engine is left (do not retry the step); `WeightVersionError` keeps a restarted engine out;
`RoutedExpertsError` is an unusable routed-experts payload (the sample fails, the rollout goes on).
"""

from sglang_patches.errors import CliError  # noqa: F401  (defined below every area; raised across the rollout)


class EngineLost(Exception):
    """The engine of an attempt was removed while the request was in flight (re-sent elsewhere)."""


class EnginesLost(RuntimeError):
    """Every engine was given up: nothing can serve the rollout."""


class WeightVersionError(RuntimeError):
    """A restarted engine serves other weights than the rollout's: it is not admitted."""


class RoutedExpertsError(ValueError):
    """A routed-experts payload is unusable. ``str(err)`` is a one-line reason."""


def one_line(x, limit: int | None = 160) -> str:
    """Any text (an answer body, an exception) as one line of at most `limit` characters (None: all)."""
    text = " ".join(str(x).split()) or (type(x).__name__ if isinstance(x, BaseException) else "")
    return text[:limit] if limit else text


def short_error(e: BaseException, limit: int = 160) -> str:
    """`Type: first line of the message`, at most `limit` characters (the type alone when there is no message)."""
    s = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {s}"[:limit] if s else type(e).__name__
