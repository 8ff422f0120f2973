"""R3 with MTP layers on a REAL megatron-core 0.16.1 GPTModel (CPU, gloo): the MTP router routes on its own.

A tiny GLM-shaped GPTModel (3 layers, layer 0 dense, 16 experts, top-4) with one MTP layer and
``moe_enable_routing_replay``: three ``TopKRouter``s register a ``RouterReplay`` (two decoder, the MTP
layer's last). The captured routing (the engine's rows: target layers only, as SGLang returns them)
covers the two decoder MoE layers.

- before the fix (``pack_replay_indices`` straight into ``RouterReplay.set_replay_data``, what
  ``load_replay`` did): megatron's count error, 2 tensors for 3 instances; and an MTP router left in
  ``REPLAY_FORWARD`` has no target (``'NoneType' object has no attribute 'to'``);
- ``load_replay(..., model=)``: the MTP router is out of replay; in one full model forward with labels
  (the MTP layer runs) in ``REPLAY_FORWARD`` the decoder routers choose exactly the captured experts
  (on their own they choose others) and the MTP router chooses what its own weights pick.

CPU shims (megatron-core hard-codes CUDA in a few places): ``torch.cuda.current_device`` -> "cpu",
``moe_utils.te_general_gemm = None`` (as scripts/gpu_check/megatron_replay.py), the default causal
mask built on CPU, and the model-parallel RNG fork (attention dropout) as a no-op context.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_mtp_router_routes_on_its_own_and_decoder_routers_replay():
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, "--worker"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["routers"] == ["decoder.layers.1.mlp.router", "decoder.layers.2.mlp.router",
                              "mtp.layers.0.transformer_layer.mlp.router"], res
    assert res["stock_error"] == "The number of replay tensors (2) does not match instances (3).", res
    assert res["stock_mtp_forward_error"] == "'NoneType' object has no attribute 'to'", res
    assert res["excluded"] == 1 and res["replaying"] == 2, res
    assert res["decoder_equal_captured"] is True, res
    assert res["decoder_own_choice_differs_rows"] > 0, res   # the replay, not the routers, chose
    assert res["mtp_routed"] is True and res["mtp_equals_own_choice"] is True, res
    assert res["no_model_error"].startswith("routing for 2 MoE layers, but 3 routers replay (MTP layers?"), res


def _worker():
    import socket
    from contextlib import nullcontext
    from unittest import mock

    import numpy as np
    import torch

    from rollout.errors import RoutedExpertsError
    from rollout.routed_experts import MoELayout
    from rollout.routed_experts.megatron_replay import load_replay, mtp_routers, pack_replay_indices

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state, tensor_parallel
        import megatron.core.fusions.fused_softmax as fused_softmax
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(1, 1)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: nullcontext()
        lay = MoELayout.from_layer_freq([0, 1, 1], 16, 4)
        torch.manual_seed(0)
        cfg = TransformerConfig(
            num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, moe_ffn_hidden_size=16,
            num_moe_experts=16, moe_router_topk=4, moe_layer_freq=[0, 1, 1], mtp_num_layers=1,
            moe_enable_routing_replay=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_score_function="sigmoid", moe_router_dtype="fp32", use_cpu_initialization=True,
            init_method_std=1.0, hidden_dropout=0.0, attention_dropout=0.0)
        cpu_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()  # noqa: E731
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
                mock.patch.object(fused_softmax, "get_default_causal_mask", cpu_mask), torch.no_grad():
            spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
            model = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=64,
                             mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
            names = [n for n, m in model.named_modules() if isinstance(m, TopKRouter)]
            routers = [model.get_submodule(n) for n in names]
            mtp = mtp_routers(model)
            decoder = [r for r in routers if not any(r is m for m in mtp)]

            lengths = [9, 7]
            rng = np.random.default_rng(3)
            samples = [np.stack([np.stack([rng.permutation(16)[:4] for _ in range(lay.num_moe_layers)])
                                 for _ in range(t - 1)]).astype(np.int32) for t in lengths]
            ids = torch.randint(0, 64, (1, sum(lengths)))
            pos = torch.arange(sum(lengths))[None]

            try:  # before the fix
                RouterReplay.set_replay_data(pack_replay_indices(samples, lay, token_lengths=lengths))
                stock_error = "accepted"
            except ValueError as e:
                stock_error = str(e)
            RouterReplay.set_replay_data([None, None, None])
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                mtp[0](torch.randn(4, 1, 32))
                stock_mtp_error = "routed"
            except AttributeError as e:
                stock_mtp_error = str(e)
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()

            try:
                load_replay(samples, lay, token_lengths=lengths)
                no_model_error = "accepted"
            except RoutedExpertsError as e:
                no_model_error = str(e)

            seen, inputs = {}, {}
            hooks = [r.register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out[1].clone()))
                     for n, r in zip(names, routers)]
            hooks += [mtp[0].register_forward_pre_hook(lambda m, a: inputs.__setitem__("mtp", a[0].clone()))]
            per_layer = load_replay(samples, lay, token_lengths=lengths, model=[model])
            replaying = len(RouterReplay.global_router_replay_instances)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            model(ids, pos, attention_mask=None, labels=ids)  # decoder + MTP layer
            RouterReplay.clear_global_router_replay_action()
            replayed = dict(seen)
            mtp_own = mtp[0](inputs["mtp"])[1]
            model(ids, pos, attention_mask=None, labels=ids)
            own = dict(seen)
            for h in hooks:
                h.remove()
        starts = np.cumsum([0] + lengths)
        real = torch.tensor([i for k in range(len(lengths)) for i in range(starts[k], starts[k + 1] - 1)])
        captured = np.concatenate(samples)
        expected = [torch.zeros(len(real), 16, dtype=torch.bool).scatter(1, torch.from_numpy(captured[:, j]).long(), True)
                    for j in range(lay.num_moe_layers)]
        dec_names = [n for n, r in zip(names, routers) if any(r is d for d in decoder)]
        res = {
            "routers": names, "stock_error": stock_error, "stock_mtp_forward_error": stock_mtp_error,
            "no_model_error": no_model_error, "excluded": len(routers) - replaying, "replaying": replaying,
            "decoder_equal_captured": all(torch.equal(replayed[n][real], e) for n, e in zip(dec_names, expected))
            and all(torch.equal(replayed[n], torch.zeros_like(replayed[n]).scatter(1, p, True))
                    for n, p in zip(dec_names, per_layer)),
            "decoder_own_choice_differs_rows": int(sum((own[n][real] != replayed[n][real]).any(1).sum()
                                                       for n in dec_names)),
            "mtp_routed": names[-1] in replayed and int(replayed[names[-1]].sum(1).eq(4).all()) == 1,
            "mtp_equals_own_choice": bool(torch.equal(replayed[names[-1]], mtp_own)),
        }
        print(json.dumps(res))
    finally:
        RouterReplay.clear_global_router_replay_instances()
        torch.distributed.destroy_process_group()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
