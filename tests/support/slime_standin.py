"""A STAND-IN for slime's rollout data types and reward hub, for tests where slime is not importable.

slime is not on PyPI. `install()` puts modules named as slime's (`slime.utils.types`,
`slime.rollout.base_types`, `slime.rollout.rm_hub`) into `sys.modules` when the real slime cannot be
imported (`REAL`), so the adapter runs on them as it runs on slime's. They answer as slime 0.3.1 / 624b824
does for what the adapter uses: `Sample`'s names, fields and field order, `append_response_tokens`
(lengths, loss mask, logprob rules, top-p spans, weight versions, finish reason -> status, prefix-cache
counts), `to_dict`/`from_dict` (unknown keys kept), `get_reward_value`; the reward hub's custom-rm rules
(per-sample `custom_rm_path` first, then `args.custom_rm_path`; batched: `args.custom_rm_path` once).
slime's rule-based rewards are not reproduced (NotImplementedError, as slime says for an unknown type).
`tests/test_slime_contract.py` pins these facts and, with slime on the path, checks them against slime.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

REAL = importlib.util.find_spec("slime") is not None  # the real slime is importable (its image, or SLIME_SRC)


def _int32(meta: dict, keys: tuple):
    """slime's decode of an int32 meta array (base64 string, bytes or list) -> list, or None."""
    value = next((meta[k] for k in keys if k in meta), None)
    if value is None:
        return None
    if isinstance(value, str):
        import base64
        value = base64.b64decode(value)
    if isinstance(value, (bytes, bytearray)):
        import numpy as np
        return np.frombuffer(bytes(value), dtype=np.int32).tolist()
    return [int(v) for v in value]


@dataclass
class Sample:  # STAND-IN for slime.utils.types.Sample
    group_index: Optional[int] = None
    index: Optional[int] = None
    rollout_id: Optional[int] = None
    prompt: Any = ""
    tokens: list = field(default_factory=list)
    multimodal_inputs: Any = None
    multimodal_train_inputs: Any = None
    multimodal_train_input_id: Any = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Any = None
    loss_mask: Optional[list] = None
    weight_versions: list = field(default_factory=list)
    rollout_log_probs: Optional[list] = None
    rollout_top_p_token_ids: Optional[list] = None
    rollout_top_p_token_offsets: Optional[list] = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: Optional[list] = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: "Sample.Status" = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: Optional[str] = None
    custom_rm_path: Optional[str] = None
    train_metadata: Optional[dict] = None
    session_id: Optional[str] = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def get_reward_value(self, args):
        return self.reward if not args.reward_key else self.reward[args.reward_key]

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable=True,
                               meta_info=None, text=None, update_terminal_info=True):
        tokens = [int(t) for t in (tokens or [])]
        log_probs = None if log_probs is None else [float(x) for x in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens = list(self.tokens) + tokens
            self.response_length += len(tokens)
            self.loss_mask = list(self.loss_mask if self.loss_mask is not None else [1] * before)
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with "
                                     "existing response tokens but no existing rollout_log_probs.")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = list(self.rollout_log_probs) + log_probs
        meta = meta_info or {}
        ids = _int32(meta, ("top_p_token_ids", "top_p_kept_token_ids"))
        offsets = _int32(meta, ("top_p_token_offsets", "top_p_kept_token_offsets"))
        if tokens and ids is not None and offsets is not None:
            base_ids = list(self.rollout_top_p_token_ids or [])
            base = list(self.rollout_top_p_token_offsets or [0])
            self.rollout_top_p_token_ids = base_ids + ids
            self.rollout_top_p_token_offsets = base + [o + base[-1] for o in offsets[1:]]
        if not update_terminal_info or "finish_reason" not in meta:
            return
        self.prefix_cache_info.cached_tokens += meta.get("cached_tokens", 0)
        self.prefix_cache_info.total_prompt_tokens += meta.get("prompt_tokens", 0)
        if "weight_version" in meta:
            self.weight_versions.append(meta["weight_version"])
        status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED,
                  "stop": Sample.Status.COMPLETED}.get(meta["finish_reason"]["type"])
        if status is not None:
            self.status = status

    def to_dict(self) -> dict:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        value["spec_info"] = dict(self.spec_info.__dict__)
        value["prefix_cache_info"] = dict(self.prefix_cache_info.__dict__)
        return value

    @staticmethod
    def from_dict(data: dict) -> "Sample":
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo(**data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo(**data.get("prefix_cache_info", {}))
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for k, v in data.items():
            if k not in names:
                setattr(sample, k, v)
        return sample


@dataclass
class RolloutFnTrainOutput:  # STAND-IN
    samples: list
    metrics: Optional[dict] = None


@dataclass
class RolloutFnEvalOutput:  # STAND-IN
    data: dict
    metrics: Optional[dict] = None


def _load_function(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


async def async_rm(args, sample, **kwargs):
    """slime's rm_hub.async_rm, custom-rm part."""
    path = sample.custom_rm_path or args.custom_rm_path
    if path is None:
        raise NotImplementedError("stand-in: slime's rule-based rewards need slime")
    return await _load_function(path)(args, sample, **kwargs)


async def batched_async_rm(args, samples, **kwargs):
    """slime's rm_hub.batched_async_rm: a custom rm gets the whole list, else async_rm per sample."""
    if args.custom_rm_path is not None:
        return await _load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))


def install() -> None:
    """Register the stand-in under slime's module names unless the real slime is importable."""
    if REAL or "slime" in sys.modules:
        return
    contents = {"slime.utils.types": {"Sample": Sample},
                "slime.rollout.base_types": {"RolloutFnTrainOutput": RolloutFnTrainOutput,
                                             "RolloutFnEvalOutput": RolloutFnEvalOutput},
                "slime.rollout.rm_hub": {"async_rm": async_rm, "batched_async_rm": batched_async_rm}}
    for name in ("slime", "slime.utils", "slime.rollout", *contents):
        module = types.ModuleType(name, "STAND-IN for slime (tests/support/slime_standin.py)")
        module.__dict__.update(contents.get(name, {}))
        sys.modules[name] = module
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, module)
