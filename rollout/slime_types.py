"""slime's rollout data types: the real ones when slime is importable, structural twins otherwise.

slime is not on PyPI, so outside slime's image `Sample`, `RolloutFnTrainOutput` and
`RolloutFnEvalOutput` here are our own dataclasses with the same names, fields and field order as
slime 0.3.1's (`slime/utils/types.py`, `slime/rollout/base_types.py`; see
shared/reference/slime-contract.md §3). `tests/test_slime_contract.py` pins the field list.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Optional

SAMPLE_FIELDS = (
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
    "multimodal_train_input_id", "apply_chat_template_kwargs", "response", "response_length", "label",
    "reward", "loss_mask", "weight_versions", "rollout_log_probs", "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets", "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status",
    "metadata", "generate_function_path", "custom_rm_path", "train_metadata", "session_id",
    "non_generation_time", "spec_info", "prefix_cache_info",
)

try:  # inside slime's image
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput  # type: ignore
    from slime.utils.types import Sample  # type: ignore
    SLIME_AVAILABLE = True
except ImportError:
    SLIME_AVAILABLE = False

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    @dataclass
    class Sample:  # noqa: F811 - structural twin of slime.utils.types.Sample
        class Status(Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

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
        status: "Sample.Status" = None
        metadata: dict = field(default_factory=dict)
        generate_function_path: Optional[str] = None
        custom_rm_path: Optional[str] = None
        train_metadata: Optional[dict] = None
        session_id: Optional[str] = None
        non_generation_time: float = 0.0
        spec_info: SpecInfo = field(default_factory=SpecInfo)
        prefix_cache_info: Any = None

        def __post_init__(self):
            if self.status is None:
                self.status = Sample.Status.PENDING

        def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable=True,
                                   meta_info=None, text=None, update_terminal_info=True):
            """Same contract as slime's: extend tokens/response, logprobs, loss mask; map finish_reason."""
            tokens = list(tokens or [])
            n = len(tokens)
            self.tokens = list(self.tokens) + tokens
            self.response_length += n
            self.response = (self.response or "") + (text or "")
            lp = list(log_probs) if (log_probs is not None and trainable) else [0.0] * n
            self.rollout_log_probs = list(self.rollout_log_probs or []) + lp
            self.loss_mask = list(self.loss_mask or []) + [1 if trainable else 0] * n
            meta = meta_info or {}
            if meta.get("weight_version") is not None:
                self.weight_versions.append(str(meta["weight_version"]))
            if update_terminal_info:
                finish = (meta.get("finish_reason") or {}).get("type")
                self.status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED,
                               "stop": Sample.Status.COMPLETED}.get(finish, self.status)

        def to_dict(self) -> dict:
            d = asdict(self)
            d["status"] = self.status.value
            return d

        @classmethod
        def from_dict(cls, d: dict) -> "Sample":
            d = dict(d)
            d["status"] = cls.Status(d.get("status", "pending"))
            if isinstance(d.get("spec_info"), dict):
                d["spec_info"] = SpecInfo(**d["spec_info"])
            return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @dataclass
    class RolloutFnTrainOutput:  # noqa: F811
        samples: list
        metrics: Optional[dict] = None

    @dataclass
    class RolloutFnEvalOutput:  # noqa: F811
        data: dict
        metrics: Optional[dict] = None


__all__ = ["SAMPLE_FIELDS", "SLIME_AVAILABLE", "RolloutFnEvalOutput", "RolloutFnTrainOutput", "Sample"]
