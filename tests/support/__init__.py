"""Test support: what several test files share (engines, transformers' reference, the SGLang stand-in,
slime's Sample stand-in, synthetic payloads). Tests import it as `support.<module>`; nothing shipped does."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
