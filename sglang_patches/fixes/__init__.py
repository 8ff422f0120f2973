"""The DP-attention fix set (one module per defect). See `sglang_patches.registry.FIX_MODULES`."""
