"""Bind a hooked call's arguments by name, whatever mix of positional and keyword the caller used."""
import inspect
from functools import lru_cache


@lru_cache(maxsize=None)
def _signature(fn):
    return inspect.signature(fn)


def bind(fn, *args, **kwargs) -> inspect.BoundArguments:
    bound = _signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def server_flag(args: dict, name: str, default=None):
    """Read a ServerArgs field from a dict of server args (rendered config or ServerArgs.__dict__)."""
    value = args.get(name, default)
    return default if value is None else value
