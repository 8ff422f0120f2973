"""Routed experts into a REAL megatron-core TopKRouter: the R3 replay check, on `cpu` or `cuda`.

Two kinds of captured routing, in one packed microbatch shaped like the tiny GLM-4.5 (3 layers,
layer 0 dense, 16 experts, top-4): (1) routing chosen by a second set of megatron routers with other
weights (a stand-in engine) and encoded as SGLang's payload; (2) a payload recorded from the REAL
SGLang CPU engine (tests/facts/sglang-0.5.23-routed-experts-tiny.json). Both are decoded, validated,
compacted, packed with slime's padding convention and loaded with ``RouterReplay.set_replay_data``; the
trainer's routers in ``REPLAY_FORWARD`` must choose exactly the captured experts, token for token,
while on their own they choose others.

    python scripts/gpu_check/megatron_replay.py cpu|cuda

prints the result as one JSON line, then one line per unmet expectation; exit 1 if any. Run it in its
own process: torch.distributed and megatron's global state stay there. `cuda`: nccl, routers and
tensors on the GPU (scripts/gpu_check/checks.py on the device). `cpu`: gloo, with two shims for
megatron-core 0.16.1 (tests/test_routed_experts_megatron.py):
- ``Router.gating`` moves CPU weights to ``torch.cuda.current_device()``: patched to return "cpu".
- ``moe_utils.te_general_gemm`` is never defined without Transformer Engine (NameError in
  ``RouterGatingLinearFunction``): set to None, megatron's own non-TE branch.
"""
import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACT = ROOT / "tests" / "facts" / "sglang-0.5.23-routed-experts-tiny.json"


def unmet(res: dict, device: str) -> list[str]:
    """The expectations `res` does not meet (empty: the replay is right)."""
    checks = {
        "the replayed routers chose the captured experts for every token": res["replay_equal_all_tokens"] is True,
        "the replay equals the stand-in engine's choice": res["replay_equals_captured"] is True,
        "the trainer's own routers choose other experts for some token": res["own_choice_differs_tokens"] > 0,
        "the real SGLang payload replayed": res["real_payload_replayed"] is True,
        "2 routers, 36 packed rows": res["num_routers"] == 2 and res["packed_rows"] == 36,
        "replay padding spread over the 4 EP ranks (at most 1 apart)": res["pad_rows_per_ep_rank_spread"] <= 1,
        f"every router and tensor on {device}": res["device"] == device,
    }
    return [what for what, ok in checks.items() if not ok]


def replay(device: str) -> dict:
    from contextlib import nullcontext
    from unittest import mock

    import numpy as np
    import torch

    from rollout.routed_experts import MoELayout, encode_sglang, load_replay, sample_routed_experts

    CAPTURED = json.loads(FACT.read_text())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cpu = device == "cpu"
    if not cpu:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(1, 1)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None  # shim 2 (see module docstring)
        lay = MoELayout.from_hf_config(CAPTURED["hf_config"])
        real = CAPTURED["full"]
        real_tokens = len(real["input_ids"] + real["output_ids"])
        hidden = 32

        def routers(seed, replay):
            torch.manual_seed(seed)
            cfg = TransformerConfig(
                num_layers=lay.num_hidden_layers, hidden_size=hidden, num_attention_heads=4,
                num_moe_experts=lay.num_experts, moe_router_topk=lay.topk, moe_enable_routing_replay=replay,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_score_function="sigmoid",
                moe_router_dtype="fp32", use_cpu_initialization=cpu, init_method_std=1.0)
            return [TopKRouter(cfg, pg_collection=moe_utils.get_default_pg_collection()) for _ in lay.moe_layers]

        def top_ids(routing_map):  # [N, E] bool -> [N, K] sorted ids
            return routing_map.nonzero()[:, 1].view(routing_map.shape[0], lay.topk)

        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu") if cpu else nullcontext():  # shim 1
            engine = routers(seed=1, replay=False)   # stand-in for the rollout engine's routers
            trainer = routers(seed=2, replay=True)   # the trainer's routers, different weights
            assert len(RouterReplay.global_router_replay_instances) == len(trainer)
            token_lengths = [7, 5, real_tokens]
            samples = [torch.randn(t, 1, hidden, generator=torch.Generator().manual_seed(10 + i)).to(device)
                       for i, t in enumerate(token_lengths)]
            compacts = []
            with torch.no_grad():
                for h, t in zip(samples[:2], token_lengths):
                    full = np.zeros((t - 1, lay.num_hidden_layers, lay.topk), np.int32)  # dense layer 0 = zeros
                    for j, layer in enumerate(lay.moe_layers):
                        full[:, layer] = top_ids(engine[j](h[:-1])[1]).cpu().numpy()  # last token: no routing
                    comp, reason = sample_routed_experts({"routed_experts": encode_sglang(full)}, t, lay)
                    assert reason is None, reason
                    compacts.append(comp)
                comp, reason = sample_routed_experts(real["meta_info"], real_tokens, lay)
                assert reason is None, reason
                compacts.append(comp)
                per_layer = load_replay(compacts, lay, token_lengths=token_lengths, pad_to_multiple=12, ep_size=4)
                n = per_layer[0].shape[0]
                packed = torch.zeros(n, 1, hidden, device=device)
                packed[: sum(token_lengths)] = torch.cat(samples)  # slime thd packing, then padding rows
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                replayed = [r(packed)[1].cpu() for r in trainer]
                RouterReplay.clear_global_router_replay_action()
                own = [r(packed)[1].cpu() for r in trainer]
                captured = [engine[j](packed)[1].cpu() for j in range(len(engine))]
                on_device = {str(t.device) for r in trainer + engine for t in r.parameters()}
        expected = [torch.zeros(n, lay.num_experts, dtype=torch.bool).scatter(1, p, True) for p in per_layer]
        starts = np.cumsum([0] + token_lengths)
        stand_in_rows = torch.tensor([*range(starts[0], starts[1] - 1), *range(starts[1], starts[2] - 1)])
        real_rows = torch.arange(starts[2], starts[3] - 1)  # each sample's last token is a padding row
        real_sets = [torch.zeros(real_tokens - 1, lay.num_experts, dtype=torch.bool).scatter(
            1, torch.from_numpy(comp[:, j]).long(), True) for j in range(lay.num_moe_layers)]
        pad_rows = torch.tensor(sorted(set(range(n)) - set(stand_in_rows.tolist()) - set(real_rows.tolist())))
        pad_per_rank = [a[pad_rows].sum(0).view(4, -1).sum(1) for a in replayed]
        res = {
            "num_routers": len(trainer), "packed_rows": n, "device": ",".join(sorted({d.split(":")[0] for d in on_device})),
            "pad_rows_per_ep_rank_spread": max(int(c.max() - c.min()) for c in pad_per_rank),
            "replay_equal_all_tokens": all(torch.equal(a, b) for a, b in zip(replayed, expected)),
            "replay_equals_captured": all(torch.equal(a[stand_in_rows], c[stand_in_rows])
                                          for a, c in zip(replayed, captured)),
            "real_payload_replayed": all(torch.equal(a[real_rows], b) for a, b in zip(replayed, real_sets)),
            "own_choice_differs_tokens": int(sum((a[stand_in_rows] != c[stand_in_rows]).any(1).sum()
                                                 for a, c in zip(own, captured))),
        }
        return res
    finally:
        RouterReplay.clear_global_router_replay_instances()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    res = replay(device)
    print(json.dumps(res))
    missed = unmet(res, device)
    for what in missed:
        print(f"megatron replay on {device}: not met: {what}")
    sys.exit(1 if missed else 0)
