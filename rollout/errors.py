"""The rollout's errors and their one-line texts, low in the house (every layer may raise them).

Which to catch: `CliError` is bad input (one line, exit 2, nothing retried); `EngineLost` is one
attempt's engine going away (the dispatcher re-sends the sample elsewhere); `EnginesLost` means no
engine is left (do not retry the step); `WeightVersionError` keeps a restarted engine out;
`RoutedExpertsError` is an unusable routed-experts payload (the sample fails, the rollout goes on).
What the engine client (`engines.client`) raises, in the style of vLLM's `EngineGenerateError` /
`EngineDeadError`: `EngineUnreachable` (no HTTP answer: retry elsewhere), `EngineRejected` (an answer
other than 200: `status`, `body`; 5xx may pass, others will not), `ApiKeyRejected` (401/403: fix the
key, waiting will not); `DispatcherClosed` means no engine will serve a sample (fail it, do not wait).
"""

from sglang_patches.errors import CliError  # noqa: F401  (defined below every area; raised across the rollout)


class EngineLost(Exception):
    """The engine of an attempt was removed while the request was in flight (re-sent elsewhere)."""


class EngineError(Exception):
    """One HTTP call to an engine (or slime's router) did not get its answer."""


class EngineUnreachable(EngineError):
    """No HTTP answer (connection refused or reset, timeout): the engine may be gone; retry elsewhere."""

    def __init__(self, engine: str, path: str, cause: BaseException):
        self.engine, self.path, self.cause = engine, path, cause
        super().__init__(f"{engine}: no answer on {path}: {short_error(cause)}")


class EngineRejected(EngineError):
    """An answer other than 200. `status >= 500` may pass (re-send); any other will not."""

    def __init__(self, engine: str, path: str, status: int, body: str):
        self.engine, self.path, self.status, self.body = engine, path, status, body
        super().__init__(f"HTTP {status} on {path} from {engine}: {one_line(body)}")

    @property
    def transient(self) -> bool:
        return self.status >= 500


class ApiKeyRejected(EngineRejected):
    """401/403: the engine refuses our API key; waiting will not fix it."""


class DispatcherClosed(Exception):
    """No engine will come back (every one given up, or none listed): a sample fails with this reason."""


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
