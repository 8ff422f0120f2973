"""Ports as data: one table per reviewed SGLang variant (`registry.VARIANTS` names it).

Each module defines `PORTS = {fix name: Port}` for both families (DP-attention and CPU). A Port pins
the hooks defined in the fix modules to the reviewed fingerprint of their targets, or states why
no hook is needed (upstream / not-needed / absent, with its test). Where a release's hooked
source is identical to a reviewed one's, its table reuses that Port by reference.
"""
