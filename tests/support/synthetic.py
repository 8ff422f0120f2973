"""Synthetic SGLang-shaped routing: the benchmarks' module (benchmarks/_synthetic.py), loaded by path."""
import importlib.util

from support import ROOT

_spec = importlib.util.spec_from_file_location("benchmarks_synthetic", ROOT / "benchmarks" / "_synthetic.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
synthetic_full = _module.synthetic_full
