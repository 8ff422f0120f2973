"""Port tables read flat (sglang_patches/ports/v0_5_*.py): each lists every fix of its release by name, in
0.5.23's order, as its own `Port(...)`, `same_as("<table>")` or `NOT_PORTED`; none reads another table."""
import ast
import sys
import types
from pathlib import Path

import pytest

from sglang_patches import registry
from sglang_patches.registry import NOT_PORTED, VARIANTS, Port, PortTableError, all_fixes, same_as

pytestmark = pytest.mark.timeout(120)
PORTS_DIR = Path(registry.__file__).parent / "ports"
TABLES = sorted({v.table for v in VARIANTS})


def literal(name: str):
    """The module's AST and its `PORTS = {...}` dict node."""
    tree = ast.parse((PORTS_DIR / f"{name}.py").read_text())
    found = [n.value for n in tree.body if isinstance(n, ast.Assign)
             and [getattr(t, "id", None) for t in n.targets] == ["PORTS"]]
    assert len(found) == 1 and isinstance(found[0], ast.Dict), f"{name}: PORTS is not one dict literal"
    return tree, found[0]


def entries(name: str) -> dict:
    """{fix name: ("port" | "not-ported" | table named by same_as)} as written in the source."""
    _, ports = literal(name)
    out = {}
    for key, value in zip(ports.keys, ports.values):
        assert key is not None, f"{name}: PORTS unpacks another table (**)"
        assert isinstance(key, ast.Constant) and isinstance(key.value, str), f"{name}: a key is not a fix name"
        call = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
        if call == "same_as":
            assert len(value.args) == 1 and isinstance(value.args[0], ast.Constant), f"{name}: {key.value}"
            out[key.value] = value.args[0].value
        elif call == "Port":
            out[key.value] = "port"
        elif isinstance(value, ast.Name) and value.id == "NOT_PORTED":
            out[key.value] = "not-ported"
        else:
            raise AssertionError(f"{name}: {key.value} is {ast.unparse(value)}, not Port(...), same_as(...) "
                                 "or NOT_PORTED")
    return out


def assembled(name: str) -> list:
    """What in the module builds its table from other tables: unpacking, comprehensions, lookups, name
    filters, imports of other tables."""
    tree, ports = literal(name)
    found = [f"**{ast.unparse(v)}" for k, v in zip(ports.keys, ports.values) if k is None]
    for node in ast.walk(tree):
        if isinstance(node, (ast.DictComp, ast.Subscript)) or (
                isinstance(node, ast.Attribute) and node.attr in ("startswith", "endswith", "PORTS")):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            found += [f"import of {a.name}" for a in node.names if a.name.startswith("v0_")]
    return found


@pytest.mark.parametrize("name", TABLES)
def test_table_names_every_fix_in_order(name):
    problems = assembled(name)
    assert not problems, f"{name} is assembled from other tables: " + "; ".join(problems)
    assert list(entries(name)) == list(entries("v0_5_23")), f"{name}: not every fix, or not in 0.5.23's order"
    assert set(entries("v0_5_23")) == {f.name for f in all_fixes()}


@pytest.mark.parametrize("name", TABLES)
def test_same_as_names_a_table_that_defines_the_port(name):
    for fix, target in entries(name).items():
        if target in ("port", "not-ported"):
            continue
        assert target in TABLES and target != name, f"{name}: {fix}: same_as({target!r}) is no other table"
        assert entries(target)[fix] == "port", f"{name}: {fix}: same_as({target!r}), whose entry is not a Port"
        assert registry.table(name)[fix] is registry.table(target)[fix]
    assert all(isinstance(p, Port) for p in registry.table(name).values())


@pytest.fixture
def fake_table(monkeypatch):
    def make(ports):
        mod = types.ModuleType("sglang_patches.ports.v0_fake")
        mod.PORTS = ports
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        registry.table.cache_clear()
        return "v0_fake"

    yield make
    registry.table.cache_clear()


@pytest.mark.parametrize("ports,error", [
    ({"cpu-ep-native-moe": same_as("v0_5_17")},
     "ports/v0_fake.py: cpu-ep-native-moe is same_as('v0_5_17'), which does not port it"),
    ({"capturer-extent": same_as("v0_5_18")},
     "ports/v0_fake.py: capturer-extent is same_as('v0_5_18'), which is itself same_as('v0_5_19')"),
    ({"capturer-extent": same_as("v0_5_99")}, "ports/v0_fake.py: capturer-extent is same_as('v0_5_99'): no such table"),
])
def test_bad_same_as_is_one_line_error(fake_table, ports, error):
    name = fake_table(ports)
    with pytest.raises(PortTableError) as e:
        registry.table(name)
    assert str(e.value) == error


def test_not_ported_is_left_out(fake_table):
    name = fake_table({"cpu-ep-native-moe": NOT_PORTED, "capturer-extent": same_as("v0_5_23")})
    assert registry.table(name) == {"capturer-extent": registry.table("v0_5_23")["capturer-extent"]}
