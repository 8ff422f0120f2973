"""Replay padding rows spread over experts and EP ranks (slime#2308, miles#2697, miles#2770).

Seed shapes (training_configs/glm4.5-355b-a32b.yaml): 92 layers (3 dense), 160 experts, top-8;
the trainer's EP is 16 (the rollout engine's is 32; both are measured).

`test_slime_padding_overloads_ep_ranks_and_hook_spreads_it` runs slime's OWN
`prepare_routed_experts_for_routing_replay` (cp_utils.py exported from the slime mirror, commit
624b824; megatron-core parallel state on gloo, world size 1) on a seed-shaped microbatch: stock,
the pad rows land on few experts (the hot EP rank gets several times the mean); with
`slime_replay_padding.install` (slime's `--custom-megatron-init-path` hook) the real rows are
unchanged and the pad load is even.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout.routed_experts import MoELayout, RoutedExpertsError, pack_replay_indices
from rollout.routed_experts.replay_padding import fill_pad_rows, load_per_rank, spread_pad_routes

ROOT = Path(__file__).resolve().parents[1]
SLIME_GIT = Path("/work/.mirror/THUDM+slime/repo")
E, K, LAYERS, DENSE = 160, 8, 92, 3


def _routes(rng, rows, layers):
    """Captured-looking routes: K distinct experts per row and layer."""
    return (rng.integers(0, E, (rows, layers, 1)) + np.arange(K)) % E


@pytest.mark.parametrize("ep", [1, 16, 32])
def test_spread_routes_distinct_and_balanced_for_every_prefix(ep):
    for layer in (0, 3, 91):
        routes = spread_pad_routes(1000, E, K, ep, layer)
        assert all(len(set(r)) == K for r in routes.tolist())
        assert routes.min() >= 0 and routes.max() < E
        for n in (1, 2, 5, 37, 1000):
            _, per_rank = load_per_rank(routes[:n], E, ep)
            assert per_rank.max() - per_rank.min() <= 1, (layer, n, per_rank)


def test_pack_replay_indices_spreads_pad_rows_and_keeps_real_rows():
    lay = MoELayout.from_first_k_dense(LAYERS, DENSE, E, K)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(20, 200, 64)]
    samples = [_routes(rng, t - 1, lay.num_moe_layers).astype(np.uint8) for t in lengths]
    per_layer = pack_replay_indices(samples, lay, token_lengths=lengths, pad_to_multiple=1024, ep_size=16)
    starts = np.cumsum([0] + lengths)
    real = np.concatenate([np.arange(s, s + t - 1) for s, t in zip(starts, lengths)])
    pad = np.setdiff1d(np.arange(per_layer[0].shape[0]), real)
    assert len(pad) == 1024 - sum(lengths) % 1024 + len(lengths) and pad.size and per_layer[0].shape[0] % 1024 == 0
    stacked = np.concatenate(samples)
    for j, t in enumerate(per_layer):
        assert t.dtype == torch.int64 and np.array_equal(t.numpy()[real], stacked[:, j])
        _, per_rank = load_per_rank(t.numpy()[pad], E, 16)
        assert per_rank.max() - per_rank.min() <= 1
        assert all(len(set(r)) == K for r in t.numpy()[pad].tolist())


def test_partially_padded_row_refused_and_missing_route_refused():
    lay = MoELayout.from_first_k_dense(4, 1, 16, 4)
    a = np.tile(np.arange(4, dtype=np.int32), (5, 4, 1))
    a[2, 1] = [3, -1, -1, -1]
    with pytest.raises(RoutedExpertsError, match=r"sample 0: row 2 layer 0: partially padded route \[3, -1, -1, -1\]"):
        pack_replay_indices([a], lay)
    a[2, 1] = -1
    with pytest.raises(RoutedExpertsError, match="sample 0: row 2 MoE layer 0 has no captured route"):
        pack_replay_indices([a], lay)
    rows = np.full((3, 2, 4), -1)
    rows[1, 0, :2] = 5
    with pytest.raises(RoutedExpertsError, match="row 1 layer 0: partially padded"):
        fill_pad_rows(rows, 16)


def test_slime_hook_refuses_changed_source(tmp_path, monkeypatch):
    from rollout.routed_experts import slime_replay_padding as srp
    (tmp_path / "slime_changed.py").write_text("def _pad_routed_experts(experts, pad, num_experts):\n"
                                              "    return experts\n\n\n"
                                              "def prepare_routed_experts_for_routing_replay(*a, **k):\n"
                                              "    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert srp.refusal("slime_changed").startswith("source of slime_changed._pad_routed_experts changed (fingerprint")
    assert srp.refusal("slime_missing").startswith("hook target missing: slime_missing._pad_routed_experts")


def _export_slime_cp_utils(dest: Path) -> Path:
    if not SLIME_GIT.is_dir():
        pytest.skip(f"slime mirror {SLIME_GIT} not present")
    rel = "slime/backends/megatron_utils/cp_utils.py"
    src = subprocess.run(["git", f"--git-dir={SLIME_GIT}", "show", f"HEAD:{rel}"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    (dest / rel).parent.mkdir(parents=True)
    (dest / rel).write_text(src)
    for pkg in ("slime", "slime/backends", "slime/backends/megatron_utils"):
        (dest / pkg / "__init__.py").write_text("")  # slime's own __init__ files import Ray etc.
    return dest


@pytest.mark.timeout(240)
def test_slime_padding_overloads_ep_ranks_and_hook_spreads_it(tmp_path):
    slime_root = _export_slime_cp_utils(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(slime_root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--worker"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))
    assert res["installed"] is True and res["real_rows_unchanged"] is True
    for ep in ("16", "32"):
        stock, fixed = res["stock"][ep], res["hooked"][ep]
        assert stock["rank_max_over_mean"] > 2.0, stock   # the defect: a few ranks take the pad tokens
        assert fixed["rank_max_minus_min"] <= 1 and fixed["ranks_used_min"] == int(ep), fixed
    assert res["hooked_rows_distinct"] is True
    assert res["partial_row_error"].startswith("row ")


def _worker():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(1, 1)
        import slime.backends.megatron_utils.cp_utils as cp_utils

        from rollout.routed_experts import slime_replay_padding

        rng = np.random.default_rng(1)
        lengths = [int(x) for x in rng.integers(300, 3000, 8)]
        experts = [torch.from_numpy(_routes(rng, t - 1, LAYERS).astype(np.int32)) for t in lengths]
        tokens = [torch.zeros(t, dtype=torch.long) for t in lengths]
        kw = dict(num_experts=E, data_pad_size_multiplier=1024, sequence_parallel=False, allgather_cp=False)

        def measure(out):
            real = np.concatenate([np.arange(s, s + t - 1) for s, t in zip(np.cumsum([0] + lengths), lengths)])
            pad = np.setdiff1d(np.arange(out.shape[0]), real)
            routes = out.numpy()[pad]
            res = {}
            for ep in (16, 32):  # EP all-to-all runs per layer: the worst MoE layer counts
                loads = [load_per_rank(routes[:, layer], E, ep) for layer in range(DENSE, LAYERS)]
                res[str(ep)] = {"pad_rows": int(len(pad)),
                                "expert_max_over_mean": round(max(float(e.max() / e.mean()) for e, _ in loads), 3),
                                "rank_max_over_mean": round(max(float(r.max() / r.mean()) for _, r in loads), 3),
                                "rank_max_minus_min": max(int(r.max() - r.min()) for _, r in loads),
                                "ranks_used_min": min(int((r > 0).sum()) for _, r in loads)}
            return res, real, pad

        stock_out = cp_utils.prepare_routed_experts_for_routing_replay(experts, tokens, **kw)
        stock, real, pad = measure(stock_out)
        installed = slime_replay_padding.install(SimpleNamespace(expert_model_parallel_size=16))
        hooked_out = cp_utils.prepare_routed_experts_for_routing_replay(experts, tokens, **kw)
        hooked, _, _ = measure(hooked_out)
        bad = [e.clone() for e in experts]
        bad[0][5, 4, 2:] = -1
        try:
            cp_utils.prepare_routed_experts_for_routing_replay(bad, tokens, **kw)
            partial = "accepted"
        except RoutedExpertsError as e:
            partial = str(e)
        print(json.dumps({
            "installed": installed, "stock": stock, "hooked": hooked, "partial_row_error": partial,
            "real_rows_unchanged": bool(torch.equal(stock_out[real], hooked_out[real])),
            "hooked_rows_distinct": all(len(set(r)) == K for r in hooked_out[pad].reshape(-1, K).tolist()),
            "dtype": str(hooked_out.dtype)}))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
