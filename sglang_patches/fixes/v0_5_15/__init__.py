"""The fix set on SGLang 0.5.15.post1: the stock wheel and slime's image (the wheel + slime's patches).

`PORTS = {fix name: {variant name: Port}}`, merged into the fixes by `registry.all_fixes()`.
Hooks whose code differs from 0.5.23 live in this package's submodules (one per fix) and reuse
the fix module's shared logic. slime's patches change none of the hooked functions (same
fingerprints on both variants); they are told apart by `ModelRunner.forward` (registry.VARIANTS).
"""
STOCK, SLIME = "0.5.15.post1", "0.5.15.post1+slime"

PORTS = {}
