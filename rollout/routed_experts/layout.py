"""Which layers of the model route tokens, and how many experts they pick from.

``MoELayout`` is all the codec needs to know about a model:
``num_hidden_layers`` (every layer SGLang reports, dense ones included),
``moe_layers`` (sorted indices of the layers that route, in model order),
``num_experts`` and ``topk``.
"""
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from rollout.errors import RoutedExpertsError


@dataclass(frozen=True)
class MoELayout:
    num_hidden_layers: int
    moe_layers: tuple
    num_experts: int
    topk: int

    def __post_init__(self):
        layers = tuple(sorted(int(i) for i in self.moe_layers))
        object.__setattr__(self, "moe_layers", layers)
        if self.num_hidden_layers <= 0 or self.topk <= 0:
            raise RoutedExpertsError("num_hidden_layers and topk must be positive")
        if not 0 < self.topk <= self.num_experts:
            raise RoutedExpertsError(f"topk={self.topk} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts > np.iinfo(np.int16).max:
            raise RoutedExpertsError(f"num_experts={self.num_experts} does not fit int16")
        if not layers or len(set(layers)) != len(layers) or layers[0] < 0 or layers[-1] >= self.num_hidden_layers:
            raise RoutedExpertsError(f"moe_layers {layers} must be distinct indices in [0, {self.num_hidden_layers})")

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_first_k_dense(cls, num_hidden_layers, first_k_dense, num_experts, topk):
        """GLM-4.5 / DeepSeek style: layers ``[0, first_k_dense)`` are dense, the rest route."""
        return cls(num_hidden_layers, tuple(range(first_k_dense, num_hidden_layers)), num_experts, topk)

    @classmethod
    def from_model(cls, model):
        """From a training config's ``model`` section (``num_layers``, ``first_k_dense_replace``,
        ``num_experts``, ``topk``)."""
        return cls.from_first_k_dense(model.num_layers, model.first_k_dense_replace, model.num_experts, model.topk)

    @classmethod
    def from_layer_freq(cls, moe_layer_freq, num_experts, topk, num_hidden_layers=None):
        """megatron's ``moe_layer_freq``: a 0/1 list (1 = MoE layer), its CLI string form
        (``"[0]*3+[1]*89"``, ``"[0,1,1]"``), or an int N (every N-th layer)."""
        if isinstance(moe_layer_freq, str):
            moe_layer_freq = _parse_freq(moe_layer_freq)
        if isinstance(moe_layer_freq, int):
            if num_hidden_layers is None:
                raise RoutedExpertsError("an int moe_layer_freq needs num_hidden_layers")
            flags = [int(i % moe_layer_freq == 0) for i in range(num_hidden_layers)]
        else:
            flags = [int(f) for f in moe_layer_freq]
            if set(flags) - {0, 1}:
                raise RoutedExpertsError(f"moe_layer_freq entries must be 0 or 1, got {sorted(set(flags))}")
            if num_hidden_layers is not None and len(flags) != num_hidden_layers:
                raise RoutedExpertsError(f"moe_layer_freq has {len(flags)} entries, model has {num_hidden_layers} layers")
        return cls(len(flags), tuple(i for i, f in enumerate(flags) if f), num_experts, topk)

    @classmethod
    def from_hf_config(cls, cfg: Mapping):
        """From a HF ``config.json`` dict (GLM-4.5: ``n_routed_experts``, ``num_experts_per_tok``,
        ``first_k_dense_replace``; DeepSeek's int ``moe_layer_freq`` is honoured too)."""
        cfg = dict(cfg)
        try:
            n_layers = int(cfg["num_hidden_layers"])
            topk = int(cfg["num_experts_per_tok"])
        except KeyError as e:
            raise RoutedExpertsError(f"HF config lacks {e.args[0]!r}") from None
        n_exp = next((cfg[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.get(k)), None)
        if n_exp is None:
            raise RoutedExpertsError("HF config has no n_routed_experts / num_experts / num_local_experts")
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        layers = tuple(i for i in range(first_dense, n_layers) if i % freq == 0)
        return cls(n_layers, layers, int(n_exp), topk)

    # --- derived ------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dense_layers(self) -> tuple:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

    @property
    def compact_dtype(self):
        """uint8 up to 256 experts, int16 above."""
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.int16)

    @property
    def moe_slice(self):
        """A ``slice`` selecting the MoE layers when they are contiguous, else None."""
        lo, hi = self.moe_layers[0], self.moe_layers[-1] + 1
        return slice(lo, hi) if hi - lo == len(self.moe_layers) else None

    def layer_flags(self) -> Sequence[int]:
        """megatron-style ``moe_layer_freq`` list (1 = MoE layer)."""
        moe = set(self.moe_layers)
        return [int(i in moe) for i in range(self.num_hidden_layers)]


_FREQ_TERM = re.compile(r"^\[([01](?:,[01])*)\](?:\*(\d+))?$")


def _parse_freq(text: str):
    """megatron's ``--moe-layer-freq`` string without eval: an int, or ``[..]*n`` terms joined by ``+``."""
    t = text.replace(" ", "")
    if t.isdigit():
        return int(t)
    flags = []
    for term in t.split("+"):
        m = _FREQ_TERM.match(term)
        if not m:
            raise RoutedExpertsError(f"cannot read moe_layer_freq {text!r} (expected e.g. [0]*3+[1]*89)")
        flags += [int(x) for x in m.group(1).split(",")] * int(m.group(2) or 1)
    return flags
