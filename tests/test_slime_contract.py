"""slime's plug-in contract (shared/reference/slime-contract.md §3), encoded as tests.

slime is not installable here; these pin the signatures slime calls and the `Sample` fields it reads,
so the adapter keeps matching slime 0.3.1 (and, inside slime's image, slime's own classes).
"""
import dataclasses
import importlib
import inspect

from rollout import slime_adapter
from rollout.slime_types import SAMPLE_FIELDS, SLIME_AVAILABLE, RolloutFnEvalOutput, RolloutFnTrainOutput, Sample
from training_configs.render import ADAPTER_GENERATE_FN, ADAPTER_ROLLOUT_FN


def _load_function(path):
    """What slime's load_function does: import the module, take the attribute."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_rollout_function_signature():
    fn = _load_function(ADAPTER_ROLLOUT_FN)
    assert fn is slime_adapter.generate_rollout
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


def test_sample_fields_and_status():
    names = [f.name for f in dataclasses.fields(Sample)]
    if SLIME_AVAILABLE:
        assert set(SAMPLE_FIELDS) <= set(names)
    else:
        assert tuple(names) == SAMPLE_FIELDS
    assert {m.name for m in Sample.Status} >= {"PENDING", "COMPLETED", "TRUNCATED", "ABORTED", "FAILED"}
    s = Sample(prompt="hi", tokens=[1, 2])
    assert s.status == Sample.Status.PENDING and s.response_length == 0 and s.loss_mask is None
    for name in ("append_response_tokens", "to_dict", "from_dict"):
        assert callable(getattr(Sample, name))


def test_sample_append_and_round_trip():
    s = Sample(prompt="p", tokens=[5, 6])
    s.append_response_tokens(None, tokens=[7, 8], log_probs=[-0.1, -0.2], meta_info={
        "finish_reason": {"type": "length"}, "weight_version": "3"}, text="ab")
    assert s.tokens == [5, 6, 7, 8] and s.response_length == 2 and s.rollout_log_probs == [-0.1, -0.2]
    assert s.loss_mask == [1, 1] and s.status == Sample.Status.TRUNCATED and s.weight_versions == ["3"]
    s.append_response_tokens(None, tokens=[9], trainable=False, meta_info={"finish_reason": {"type": "stop"}})
    assert s.loss_mask == [1, 1, 0] and s.rollout_log_probs[-1] == 0.0 and s.status == Sample.Status.COMPLETED
    back = Sample.from_dict(s.to_dict())
    assert back.tokens == s.tokens and back.status == s.status


def test_output_types():
    out = RolloutFnTrainOutput(samples=[[Sample()]])
    assert out.metrics is None and len(out.samples) == 1
    assert [f.name for f in dataclasses.fields(RolloutFnTrainOutput)][:2] == ["samples", "metrics"]
    ev = RolloutFnEvalOutput(data={"d": {"rewards": [], "truncated": [], "samples": []}})
    assert ev.metrics is None


def test_evaluation_is_refused_with_a_reason():
    import pytest
    with pytest.raises(NotImplementedError, match="eval-function-path"):
        slime_adapter.generate_rollout(object(), 0, None, evaluation=True)


def test_router_address_from_either_slime_convention():
    from types import SimpleNamespace

    import pytest
    assert slime_adapter.router_url(SimpleNamespace(sglang_router_ip="10.0.0.1", sglang_router_port=3001)) \
        == "http://10.0.0.1:3001"
    assert slime_adapter.router_url(SimpleNamespace(sglang_router_ip=None, sglang_router_port=None,
                                                    sglang_model_routers={"default": ("10.0.0.2", 3002)})) \
        == "http://10.0.0.2:3002"
    with pytest.raises(ValueError, match="no slime router address"):
        slime_adapter.router_url(SimpleNamespace())
