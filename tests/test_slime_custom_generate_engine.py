"""A slime-style 2-turn generate function (tool observation, loss mask 0) in plugin mode on a real SGLang CPU
engine (configuration (a): tiny GLM-4.5 MoE, routed experts). slime's router is test_slime_adapter's discovery
STAND-IN listing the real engine. Every turn must reach the engine through the manager, come back with the
routed experts of its whole sequence (equal to transformers' router top-k) and find its prefix cached.
"""
import base64
import os

import numpy as np
import pytest
from support.engines import preset
from rollout.models.reference import hf_router_topk
from rollout.models.tiny import NUM_LAYERS, TOP_K
from test_slime_adapter import StandInRouter
from test_slime_adapter_engine import TextDataSource
from test_slime_custom_generate import post

from rollout.slime import Sample
from rollout.slime import adapter as slime_adapter

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TURNS = []


async def tool_turns(args, sample, sampling_params):
    """slime's style: tokenize the prompt, post to args.sglang_router_ip/port, append SGLang's tokens (trainable) and a tool
    observation (loss mask 0), post again with the whole sequence."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    ids = list(sample.tokens) or _tokenizer(args).encode(sample.prompt, add_special_tokens=False)   # as slime's
    sample.tokens = list(ids)
    prompt_len, mask = len(ids), []
    for turn in range(2):
        out = await post(url, {"input_ids": ids, "sampling_params": sampling_params, "return_logprob": True,
                               "return_routed_experts": True})
        meta = out["meta_info"]
        new = [p[1] for p in meta["output_token_logprobs"]]
        TURNS.append((list(ids), new, meta))
        ids += new
        mask += [1] * len(new)
        if turn == 0:
            obs = [5, 6, 7, 8]   # the tool's answer
            ids += obs
            mask += [0] * len(obs)
    sample.tokens, sample.response_length, sample.loss_mask = ids, len(ids) - prompt_len, mask
    sample.status = Sample.Status.COMPLETED
    return sample


def _tokenizer(args):
    """The prompt's tokens, as slime's functions get them (`GenerateState(args).tokenizer`): slime's data source
    gives text prompts."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(args.hf_checkpoint)


def test_two_turn_function_on_a_real_engine(engine_pool, tiny_model, monkeypatch):
    eng = engine_pool.get("a", preset("a", tiny_model))
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_CONFIG", os.path.join(ROOT, "training_configs", "tiny-cpu.yaml"))
    slime_adapter.reset()
    TURNS.clear()
    router = StandInRouter([(eng.url, "regular")]).start()
    from types import SimpleNamespace
    args = SimpleNamespace(
        sglang_router_ip="127.0.0.1", sglang_router_port=router.port, sglang_api_key=eng.api_key,
        hf_checkpoint=tiny_model, n_samples_per_prompt=2, rollout_batch_size=2, sglang_server_concurrency=4,
        use_rollout_routing_replay=True, rollout_temperature=0.0, rollout_top_p=1.0, rollout_top_k=-1,
        rollout_max_response_len=6, custom_rm_path="test_slime_adapter.length_reward",
        custom_generate_function_path=f"{__name__}.tool_turns")
    try:
        out = slime_adapter.generate_rollout(args, 3, TextDataSource(["the quick brown fox",
                                                                      "rollout routing replay records experts"], 2))
    finally:
        slime_adapter.reset()
        router.stop()
    assert router.requests == []   # every turn went to the engine, through the manager
    assert len(TURNS) == 8 and len(out.samples) == 2   # 2 groups x 2 samples x 2 turns
    for ids, new, meta in TURNS:
        seq = ids + new
        re = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, NUM_LAYERS, TOP_K)
        assert re.shape[0] == len(seq) - 1 and meta["routed_experts_start_len"] == 0
        hf = hf_router_topk(tiny_model, seq[:-1])
        for layer in range(1, NUM_LAYERS):
            assert [sorted(r) for r in re[:, layer, :].tolist()] == hf[layer], f"layer {layer}"
    second = [meta for ids, new, meta in TURNS if ids[-4:] == [5, 6, 7, 8]]   # after the tool observation
    assert len(second) == 4 and all(m.get("cached_tokens", 0) > 0 for m in second), [m.get("cached_tokens") for m in second]
    for g in out.samples:
        for s in g:
            assert s.loss_mask.count(0) == 4 and s.reward == float(s.response_length)
