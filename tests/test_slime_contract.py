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


# slime 624b824, what plugin mode's direct dispatch relies on:
# - slime/rollout/sglang_rollout.py `abort`: `GET {router}/workers`, then `worker["url"] for worker in
#   response["workers"]` -> abort_servers_until_idle(urls): the router is a worker registry slime lists;
# - slime/backends/sglang_utils/sglang_engine.py: `_register_to_router` POSTs {"url", "worker_type"} to
#   `{router}/workers`; `shutdown` DELETEs `{router}/workers/{id}`; `pause_generation` /
#   `continue_generation` POST to `{server_host}:{server_port}` (the engine), never to the router;
# - slime/ray/rollout.py `_start_router`: `disable_health_check = True` (the router never marks a worker
#   unhealthy: slime's own health monitor kills and unregisters it).
SLIME_ROUTER_CALLS = {
    ("slime.rollout.sglang_rollout", "abort"): ["/workers\"", "response[\"workers\"]", "worker[\"url\"]"],
    ("slime.backends.sglang_utils.sglang_engine", "SGLangEngine._register_to_router"):
        ["/workers\"", "\"url\": worker_url", "\"worker_type\": self.worker_type"],
    ("slime.backends.sglang_utils.sglang_engine", "SGLangEngine.pause_generation"):
        ["{self.server_host}:{self.server_port}/pause_generation"],
    ("slime.ray.rollout", "_start_router"): ["disable_health_check = True"],
}
# tests/facts/sglang-router-0.3.2-workers.json (scripts/probe_router_fields.py on the real router).
ROUTER_WORKER_KEYS = {"id", "url", "worker_type", "is_healthy"}


@pytest.mark.parametrize("where", list(SLIME_ROUTER_CALLS), ids=lambda w: w[1])
def test_slime_uses_its_router_as_a_worker_registry(where):
    module, qual = where
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"slime is not importable ({e}): put a slime checkout on PYTHONPATH")
    for part in qual.split("."):
        obj = getattr(obj, part)
    src = inspect.getsource(obj)
    for needle in SLIME_ROUTER_CALLS[where]:
        assert needle in src, f"slime's {qual} no longer has {needle!r}"


def test_plugin_mode_sends_to_the_workers_the_router_lists():
    """Routed experts must not depend on the router build: every PyPI sglang-router drops the field."""
    import json
    import os
    with open(os.path.join(os.path.dirname(__file__), "facts", "sglang-router-0.3.2-workers.json")) as fh:
        fact = json.load(fh)
    assert fact["forwards_return_routed_experts"] is False and "return_routed_experts" not in fact["keys_received"]
    entry = fact["workers_listing"]["workers"][0]
    assert ROUTER_WORKER_KEYS <= set(entry) and entry["worker_type"] == "regular"
    from rollout.slime.attach import RouterWorkers
    workers = RouterWorkers("http://r:1", "key")
    send, abort = workers.split([dict(entry, url="http://w:2"), dict(entry, url="http://p:3", worker_type="prefill")])
    assert [(e.url, e.api_key) for e in send] == [("http://w:2", "key")]
    assert [e.url for e in abort] == ["http://w:2", "http://p:3"]   # stragglers aborted on every listed worker
    send, abort = workers.split([dict(entry, url="http://p:3", worker_type="prefill"),
                                 dict(entry, url="http://d:4", worker_type="decode")])
    assert [e.url for e in send] == ["http://r:1"] and [e.url for e in abort] == ["http://p:3", "http://d:4"]
