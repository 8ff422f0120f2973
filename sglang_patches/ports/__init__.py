"""Ports as data: one table per reviewed SGLang variant (`registry.VARIANTS` names it).

Each module defines `PORTS = {fix name: entry}`: every fix of every family (DP-attention, r3, CPU, opt-in
features), one line each, in 0.5.23's order. An entry is a `Port` (the hooks defined in the fix modules
pinned to the reviewed fingerprint of their targets, or why no hook is needed: upstream / not-needed /
absent, with its test), `same_as("<table>")` where the hooked source is identical to that table's (it
names the table whose own entry is the Port: no reference to a reference) or `NOT_PORTED`. No table
reads another; `registry.table` resolves the references. Test names several tables cite live here.
"""
MATRIX = "tests/test_version_matrix.py"
FIX_TEST, GUARD_TEST = f"{MATRIX}::test_fix_on_variant", f"{MATRIX}::test_guard_on_variant"
ENGINE_TEST_0_5_15 = "tests/test_engine_v0_5_15.py::test_a_routed_experts_match_transformers"
