"""Source fingerprints of hooked SGLang targets, read without importing the target module.

`fingerprint(target)` equals sha256(inspect.getsource(obj))[:16]: the same lines (decorators
included) are read from the module file via `ast`, so checking a fingerprint never runs
SGLang code beyond package `__init__` files.
"""
import ast
import hashlib
import importlib.util
from functools import lru_cache


class TargetNotFound(LookupError):
    pass


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def split_target(target: str) -> tuple[str, list[str]]:
    """'pkg.mod.Class.meth' -> ('pkg.mod', ['Class', 'meth'])."""
    parts = target.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as e:
            raise TargetNotFound(f"{target}: cannot locate module {name} ({e})") from None
        if spec is None:
            raise TargetNotFound(f"{target}: no module {name}")
        if spec.submodule_search_locations is None:
            return name, parts[i:]
    raise TargetNotFound(f"{target}: names a package, not a function")


@lru_cache(maxsize=None)
def _module_source(module: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(module)
    with open(spec.origin) as f:
        return spec.origin, f.read()


def _find(body, name):
    found = None  # the last definition wins, as at import time
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = node
    return found


def source_of(target: str) -> str:
    module, qualname = split_target(target)
    if not qualname:
        raise TargetNotFound(f"{target}: names a module, not a function")
    path, text = _module_source(module)
    body = ast.parse(text).body
    node = None
    for name in qualname:
        node = _find(body, name)
        if node is None:
            raise TargetNotFound(f"{target}: {name} not found in {path}")
        body = node.body
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text.splitlines(keepends=True)
    return "".join(lines[first - 1 : node.end_lineno])


def fingerprint(target: str) -> str:
    return digest(source_of(target))
