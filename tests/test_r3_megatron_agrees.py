"""megatron-core agrees with the transformers replay arm: same hidden states, same indices and weights.

The near-tie tiny GLM-4.5 runs in transformers (bf16) with the routing a REAL SGLang engine captured
(tests/facts/r3-near-tie-sglang-0.5.23.json) replayed through `rollout.r3.replay`; the input of every
MoE router is recorded. Those hidden states, packed one sample after another (slime's thd layout),
go through REAL megatron-core 0.16.1 `TopKRouter`s (the checkpoint's router weights and correction
bias as `expert_bias`, sigmoid, 4 groups keep 2, scaling 2.5, fp32 router) in
`RouterReplayAction.REPLAY_FORWARD`, fed by `pack_replay_indices`. Every real row must pick the same
experts with the same weights as the transformers arm; without replay, megatron's own choice differs.
CPU shims as in scripts/gpu_check/megatron_replay.py. Runs in a subprocess (megatron state).
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "tests" / "facts" / "r3-near-tie-sglang-0.5.23.json"


def test_megatron_router_replay_equals_transformers_replay_arm(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, "--worker", str(tmp_path / "m")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["routers"] == 4 and res["real_rows"] > 200, res
    assert res["indices_equal"] is True, res
    assert res["max_weight_diff"] <= 1e-6, res
    assert res["captured_equal"] is True, res           # both replay exactly what SGLang captured
    assert res["own_choice_differs_rows"] > 0, res     # replay took effect (megatron alone picks others)


def _worker(model_dir: str):
    from unittest import mock

    import numpy as np
    import torch

    from rollout.models.near_tie import build_near_tie_glm
    from rollout.r3.check import RolloutSample
    from rollout.r3.replay import load_model, moe_gates, routing_seam
    from rollout.routed_experts import MoELayout, pack_replay_indices

    facts = json.loads(FACTS.read_text())
    samples = [RolloutSample.from_dict(d) for d in facts["samples"][:6]]
    path = build_near_tie_glm(model_dir, seed=facts["meta"]["build"]["seed"])
    model = load_model(path, "bfloat16")
    cfg = json.loads((Path(path) / "config.json").read_text())
    layout = MoELayout.from_hf_config(cfg)
    gates = moe_gates(model)

    # transformers arm: replay each sample's captured rows, record the router inputs and outputs
    hidden, hf_idx, hf_w = [[] for _ in gates], [[] for _ in gates], [[] for _ in gates]
    def keep(j):
        def fn(mod, args, out):  # registered after the seam's hook: sees the replayed output
            hf_w[j].append(out[1])
            hf_idx[j].append(out[2])
        return fn

    pre = [g.register_forward_pre_hook(lambda m, a, j=j: hidden[j].append(a[0].reshape(-1, a[0].shape[-1])))
           for j, g in enumerate(gates)]
    for s in samples:
        replay = [torch.from_numpy(s.routed_experts[:, j].astype(np.int64)) for j in range(len(gates))]
        with torch.no_grad(), routing_seam(model, replay=replay):
            post = [g.register_forward_hook(keep(j)) for j, g in enumerate(gates)]
            try:
                model(torch.tensor([s.prompt_ids + s.response_ids]))
            finally:
                for h in post:
                    h.remove()
    for h in pre:
        h.remove()

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(1, 1)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        tcfg = TransformerConfig(
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=4,
            num_moe_experts=cfg["n_routed_experts"], moe_router_topk=cfg["num_experts_per_tok"],
            moe_enable_routing_replay=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=cfg["n_group"], moe_router_group_topk=cfg["topk_group"],
            moe_router_topk_scaling_factor=cfg["routed_scaling_factor"], moe_router_dtype="fp32",
            add_bias_linear=False, use_cpu_initialization=True)  # GLM's router has no bias (slime: --disable-bias-linear)
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            routers = [TopKRouter(tcfg, pg_collection=moe_utils.get_default_pg_collection()) for _ in gates]
            with torch.no_grad():
                for r, g in zip(routers, gates):
                    r.weight.copy_(g.weight.float())
                    r.expert_bias.copy_(g.e_score_correction_bias.float())
            lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
            per_layer = pack_replay_indices([s.routed_experts for s in samples], layout, token_lengths=lengths)
            RouterReplay.set_replay_data(per_layer)
            packed = [torch.cat(h).unsqueeze(1) for h in hidden]   # [sum T, 1, H], one sample after another
            with torch.no_grad():
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                replayed = [r(x) for r, x in zip(routers, packed)]
                RouterReplay.clear_global_router_replay_action()
                own = [r(x) for r, x in zip(routers, packed)]
    finally:
        RouterReplay.clear_global_router_replay_instances()
        torch.distributed.destroy_process_group()

    starts = np.cumsum([0] + lengths)
    real = torch.tensor([i for k in range(len(samples)) for i in range(starts[k], starts[k + 1] - 1)])
    captured = torch.from_numpy(np.concatenate([s.routed_experts for s in samples]).astype(np.int64))
    idx_equal, cap_equal, max_diff, differs = True, True, 0.0, 0
    for j, ((probs, rmap), (_, own_map)) in enumerate(zip(replayed, own)):
        hf_i = torch.cat(hf_idx[j])[real].long()
        hf_dense = torch.zeros(len(real), rmap.shape[1]).scatter(1, hf_i, torch.cat(hf_w[j])[real].float())
        hf_map = hf_dense > 0
        idx_equal &= torch.equal(rmap[real], hf_map)
        cap_equal &= torch.equal(rmap[real], torch.zeros_like(hf_map).scatter(1, captured[:, j], True))
        max_diff = max(max_diff, float((probs[real].float() - hf_dense).abs().max()))
        differs += int((own_map[real] != rmap[real]).any(1).sum())
    print(json.dumps({"routers": len(routers), "real_rows": len(real), "indices_equal": bool(idx_equal),
                      "captured_equal": bool(cap_equal), "max_weight_diff": max_diff,
                      "own_choice_differs_rows": differs}))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[-1])
