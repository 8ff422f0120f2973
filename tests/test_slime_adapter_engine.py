"""The slime adapter against a real SGLang CPU engine (configuration (a): tiny GLM-4.5 MoE, routed experts).

slime's router is the discovery STAND-IN of test_slime_adapter.py (it answers `GET /workers` as
sglang-router 0.3.2 was recorded answering) listing the real engine, which plugin mode then sends
its requests to. The tokenizer is the tiny
model's own (text prompts, as slime's data source gives them). slime's `rollout_routed_experts`
built by the adapter must equal transformers' router top-k for every token and MoE layer.
"""
import os
from types import SimpleNamespace

import pytest
from support.engines import preset
from rollout.models.reference import hf_router_topk
from test_slime_adapter import StandInRouter

from rollout.slime import RolloutFnTrainOutput, Sample
from rollout.slime import adapter as slime_adapter
from rollout.models.tiny import NUM_LAYERS, TOP_K

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # starts an engine: kept out of `make test`
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TextDataSource:
    """STAND-IN for slime's data source (which needs a prompt file and its buffer): text prompts."""

    def __init__(self, prompts, n):
        self.prompts, self.n = list(prompts), n

    def get_samples(self, k):
        out = []
        for i in range(k):
            p = self.prompts.pop(0)
            out.append([Sample(group_index=i, index=j, prompt=p) for j in range(self.n)])
        return out


def test_generate_rollout_on_a_real_engine(engine_pool, tiny_model, monkeypatch):
    eng = engine_pool.get("a", preset("a", tiny_model))
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_CONFIG", os.path.join(ROOT, "training_configs", "tiny-cpu.yaml"))
    slime_adapter.reset()
    router = StandInRouter([(eng.url, "regular")]).start()
    args = SimpleNamespace(
        sglang_router_ip="127.0.0.1", sglang_router_port=router.port, sglang_api_key=eng.api_key,
        hf_checkpoint=tiny_model, n_samples_per_prompt=2, rollout_batch_size=2, sglang_server_concurrency=4,
        use_rollout_routing_replay=True, rollout_temperature=0.0, rollout_top_p=1.0, rollout_top_k=-1,
        rollout_max_response_len=6,
        # slime's own async_rm (used whenever slime is importable) reads args.rm_type unless a custom rm is set
        custom_rm_path="test_slime_adapter.length_reward")
    try:
        out = slime_adapter.generate_rollout(args, 3, TextDataSource(["the quick brown fox",
                                                                      "rollout routing replay records experts"], 2))
    finally:
        slime_adapter.reset()
        router.stop()
    assert router.requests == []   # every request went to the engine itself
    assert isinstance(out, RolloutFnTrainOutput) and len(out.samples) == 2
    for group in out.samples:
        assert len(group) == 2 and group[0].tokens == group[1].tokens   # greedy: identical siblings
        for s in group:
            assert s.rollout_id is None and 0 < s.response_length <= 6
            assert s.reward == float(s.response_length)
            assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
            re = s.rollout_routed_experts
            assert tuple(re.shape) == (len(s.tokens) - 1, NUM_LAYERS, TOP_K) and str(re.dtype) == "torch.int32"
            assert (re[:, 0, :] == 0).all()
            hf = hf_router_topk(tiny_model, s.tokens[:-1])
            for layer in range(1, NUM_LAYERS):
                assert [sorted(r) for r in re[:, layer, :].tolist()] == hf[layer], f"layer {layer}"
