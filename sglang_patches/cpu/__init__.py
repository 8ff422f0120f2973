"""CPU enablement: what real SGLang needs to run on a CPU-only machine."""
