"""Torch implementations of the `sgl_kernel` CPU ops SGLang calls (filled in per op)."""

OPS = {}
