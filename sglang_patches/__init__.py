"""DP-attention fixes for SGLang, delivered as an SGLang general plugin.

Keep this module light: a `.pth` hook imports `sglang_patches.cpu.site_hook` at
interpreter start in CPU environments.
"""
