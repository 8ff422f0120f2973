"""slime's plug-in contract as FACTS read from THUDM/slime 624b824 (not from this project's modules).

Each literal below is what slime's code does; the project (or slime itself, when importable) must match.
slime's own downstream code on the adapter's output: tests/test_slime_real.py.
"""
import dataclasses
import importlib
import inspect
from types import SimpleNamespace

import pytest

from rollout.slime import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample, adapter
from training_configs.render import ADAPTER_GENERATE_FN, ADAPTER_ROLLOUT_FN

# slime/utils/types.py: Sample's fields, in order.
SLIME_SAMPLE_FIELDS = (
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
    "multimodal_train_input_id", "apply_chat_template_kwargs", "response", "response_length", "label",
    "reward", "loss_mask", "weight_versions", "rollout_log_probs", "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets", "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status",
    "metadata", "generate_function_path", "custom_rm_path", "train_metadata", "session_id",
    "non_generation_time", "spec_info", "prefix_cache_info",
)


def _load_function(path):
    """What slime's load_function does: import the module, take the attribute."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_rollout_function_signature():
    fn = _load_function(ADAPTER_ROLLOUT_FN)
    assert ADAPTER_ROLLOUT_FN == "rollout.slime.generate_rollout" and fn is adapter.generate_rollout
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == ["args", "rollout_id", "data_source", "evaluation"]
    assert params[3].default is False
    assert not inspect.iscoroutinefunction(fn)   # slime calls it synchronously (call_rollout_fn)


def test_custom_generate_signature():
    fn = _load_function(ADAPTER_GENERATE_FN)
    assert inspect.iscoroutinefunction(fn)
    params = list(inspect.signature(fn).parameters)
    assert params[:3] == ["args", "sample", "sampling_params"]
    assert "evaluation" in params       # slime passes evaluation= when the signature has it


def test_sample_fields_and_defaults():
    assert tuple(f.name for f in dataclasses.fields(Sample)) == SLIME_SAMPLE_FIELDS
    assert [m.value for m in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    s = Sample(prompt="hi", tokens=[1, 2])
    assert s.status == Sample.Status.PENDING and s.response_length == 0 and s.loss_mask is None
    assert s.rollout_id is None and s.rollout_log_probs is None and s.response == ""
    assert s.prefix_cache_info.cached_tokens == 0 and s.spec_info.spec_verify_ct == 0


def test_append_response_tokens_rules():
    s = Sample(prompt="p", tokens=[5, 6])
    with pytest.raises(ValueError, match="trainable response tokens require rollout log probabilities"):
        s.append_response_tokens(None, tokens=[7])
    s.append_response_tokens(None, tokens=[7, 8], log_probs=[-0.1, -0.2], text="ab", meta_info={
        "finish_reason": {"type": "length"}, "weight_version": "3", "cached_tokens": 1, "prompt_tokens": 2})
    assert s.tokens == [5, 6, 7, 8] and s.response_length == 2 and s.rollout_log_probs == [-0.1, -0.2]
    assert s.loss_mask == [1, 1] and s.status == Sample.Status.TRUNCATED and s.weight_versions == ["3"]
    assert s.response == "ab" and s.prefix_cache_info.cached_tokens == 1
    s.append_response_tokens(None, tokens=[9], trainable=False, meta_info={"finish_reason": {"type": "stop"}})
    assert s.loss_mask == [1, 1, 0] and s.rollout_log_probs[-1] == 0.0 and s.status == Sample.Status.COMPLETED
    s.append_response_tokens(None, tokens=[], meta_info={"finish_reason": {"type": "abort"}})
    assert s.status == Sample.Status.ABORTED


def test_round_trip_keeps_unknown_keys_and_reward_key():
    s = Sample(prompt="p", tokens=[1], reward={"acc": 1.0})
    d = s.to_dict()
    assert d["status"] == "pending" and d["prefix_cache_info"] == {"cached_tokens": 0, "total_prompt_tokens": 0}
    d["extra_field"] = 5
    back = Sample.from_dict(d)
    assert back.tokens == [1] and back.status == Sample.Status.PENDING and back.extra_field == 5
    assert back.get_reward_value(SimpleNamespace(reward_key="acc")) == 1.0


def test_output_types():
    out = RolloutFnTrainOutput(samples=[[Sample()]])
    assert out.metrics is None and [f.name for f in dataclasses.fields(RolloutFnTrainOutput)] == ["samples", "metrics"]
    ev = RolloutFnEvalOutput(data={"d": {"rewards": [], "truncated": [], "samples": []}})
    assert ev.metrics is None and [f.name for f in dataclasses.fields(RolloutFnEvalOutput)] == ["data", "metrics"]


def test_router_address_from_either_slime_convention():
    from rollout.slime.attach import router_url
    assert router_url(SimpleNamespace(sglang_router_ip="10.0.0.1", sglang_router_port=3001)) == "http://10.0.0.1:3001"
    assert router_url(SimpleNamespace(sglang_router_ip=None, sglang_router_port=None,
                                      sglang_model_routers={"default": ("10.0.0.2", 3002)})) == "http://10.0.0.2:3002"
    with pytest.raises(ValueError, match="no slime router address"):
        router_url(SimpleNamespace())
