"""What plugin mode keeps between slime's calls in this process: the backend (a `RolloutManager`), the
tokenizer, the slime groups each manager group stands for, and the event loop they run on; and how slime's own
helpers are loaded where slime is importable."""
from __future__ import annotations

import importlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from rollout.slime import attach

_UNSET = object()


@dataclass
class State:
    """What the adapter keeps between slime's calls in this process."""

    backend: Any = None       # a RolloutManager (attached to slime's workers, or given by set_backend)
    tokenizer: Any = _UNSET   # None: every prompt arrives as tokens; unset: slime's hf_checkpoint's
    pending: dict = field(default_factory=dict)   # manager group id -> slime samples (carried too)
    loop: Optional[attach.Loop] = None            # kept across reset(): the backend's event loop thread
    sample_ids: Iterator[int] = field(default_factory=itertools.count)   # unique in this process

    def reset(self) -> None:
        """Stop the backend (closing its HTTP session) and forget it, with its carried groups and the tokenizer."""
        backend, self.backend = self.backend, None
        if backend is not None and self.loop is not None:
            backend.drop_carried()
            self.loop.run(backend.stop())
        self.tokenizer, self.pending = _UNSET, {}


STATE = State()
_LOCK = threading.Lock()
SLIME = {  # slime's own rollout helpers (importable wherever slime calls this adapter)
    "eval": "slime.rollout.sglang_rollout.generate_rollout",
    "hooks": "slime.rollout.sample_hooks.apply_rollout_sample_hooks",
    "async_rm": "slime.rollout.rm_hub.async_rm",
    "batched_async_rm": "slime.rollout.rm_hub.batched_async_rm",
    "call_dynamic_filter": "slime.rollout.filter_hub.base_types.call_dynamic_filter",
    "should_drop": "slime.rollout.filter_hub.base_types.should_drop_dynamic_filter_output",
    "MetricGatherer": "slime.rollout.filter_hub.base_types.MetricGatherer",
    "loop": "slime.utils.async_utils.get_async_loop",
}


def load(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def slime_helper(name: str, why: str):
    try:
        return load(SLIME[name])
    except ImportError as e:
        raise RuntimeError(f"{why} needs slime importable ({e})") from None


def loop() -> attach.Loop:
    """slime's own loop thread (`slime.utils.async_utils`) where slime is importable, so rewards and their
    loop-bound clients (remote_rm's session) share one loop with slime's eval; else one of ours."""
    with _LOCK:
        if STATE.loop is None:
            try:
                STATE.loop = attach.Loop(load(SLIME["loop"])().loop)
            except ImportError:
                STATE.loop = attach.Loop()
        return STATE.loop


def set_backend(backend, tokenizer=None) -> None:
    """Use `backend` (a `RolloutManager`, attached or started) for every later call."""
    STATE.backend, STATE.tokenizer = backend, tokenizer


def set_tokenizer(tokenizer) -> None:
    """The tokenizer for prompts without tokens (None: every prompt arrives as tokens)."""
    STATE.tokenizer = tokenizer


def reset() -> None:
    """Stop the backend (closing its HTTP session) and forget it, with its carried groups (the next call
    attaches again)."""
    STATE.reset()


def ensure(args):
    if STATE.backend is None:
        tokenizer = _load_tokenizer(args) if STATE.tokenizer is _UNSET else STATE.tokenizer
        set_backend(loop().run(attach.attach_workers(args)), tokenizer)
    return STATE.backend, STATE.tokenizer


def _load_tokenizer(args):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
