"""The house's layering, read from the source with `ast`: each package imports only the packages below
it (sglang_patches <- training_configs <- rollout <- benchmarks, scripts), and nothing shipped imports,
or runs anything of `tests/` as a program (recorded facts under tests/facts/ are data, read as files;
`patches status` names the test that holds each fix)."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BELOW = {"sglang_patches": set(), "training_configs": {"sglang_patches"},
         "rollout": {"sglang_patches", "training_configs"},
         "benchmarks": {"sglang_patches", "training_configs", "rollout"},
         "scripts": {"sglang_patches", "training_configs", "rollout"}}
TEST_NAMES = {"tests", "support", "conftest"}
TEST_FILE = re.compile(r"(\S*/)?tests/[\w/]*\.py")  # a test module's path


def problems(source: str, package: str) -> list[str]:
    """What in `source` (a module of `package`) breaks the layering."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:  # a test module's path in an argv list or a call: run as a program
            args = node.elts if isinstance(node, (ast.List, ast.Tuple)) else node.args if isinstance(node, ast.Call) else []
            out += [f"runs a test file: {a.value!r}" for a in args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and TEST_FILE.fullmatch(a.value)]
            continue
        for name in names:
            top = name.split(".")[0]
            if top in TEST_NAMES or top.startswith("test_"):
                out.append(f"imports {name} from the tests")
            elif top in BELOW and top != package and top not in BELOW[package]:
                out.append(f"imports {name}, a package above it")
    return out


def test_the_rule_names_what_it_refuses():
    assert problems("from rollout.net import free_port", "training_configs") == [
        "imports rollout.net, a package above it"]
    assert problems("import support.engines\nfrom test_x import Y", "scripts") == [
        "imports support.engines from the tests", "imports test_x from the tests"]
    assert problems("py(['tests/test_a.py', '--check'])", "scripts") == ["runs a test file: 'tests/test_a.py'"]
    assert problems("from training_configs import schema", "rollout") == []


@pytest.mark.parametrize("package", sorted(BELOW))
def test_each_package_imports_only_below_it_and_never_the_tests(package):
    found = {str(p.relative_to(ROOT)): problems(p.read_text(), package)
             for p in sorted((ROOT / package).rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}
