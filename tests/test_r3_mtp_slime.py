"""R3 with MTP layers in slime's OWN trainer code: `fill_routing_replay` asserts (slime#1556); the init hook fixes it.

slime 624b824 (the mirror, `git archive`) runs as it is: `MegatronTrainRayActor.fill_routing_replay`,
`RoutingReplay`, `DataIterator`, `prepare_routed_experts_for_routing_replay`, on a REAL megatron-core
0.16.1 GPTModel (3 layers, layer 0 dense, 16 experts, top-4, one MTP layer; CPU, gloo) built from a copy
of the installed megatron-core with slime's own megatron patch applied for its two routing-replay
files (`moe/router.py`: every TopKRouter registers a `RoutingReplay`; `moe/moe_utils.py`: top-k through
`ROUTING_REPLAY_STAGE`).

- stock: slime's loop fills the two decoder MoE layers, then `assert routing_replay_offset ==
  len(RoutingReplay.all_routing_replays)` fails: the MTP router's replay is the third;
- `slime_replay_padding.install(args)` with `args.mtp_num_layers`: the fill passes, and in one full model
  forward (labels given, the MTP layer runs) under slime's "replay_forward" stage the decoder routers
  choose exactly the captured experts while the MTP router chooses what its own weights pick.

Stand-ins, named: `megatron.training` (not in the megatron-core wheel), `torch_memory_saver` (CUDA-only)
and `wandb` are modules whose every attribute is a placeholder; slime's actor only imports them. The
model chunk's DDP wrapper is `DDPStandIn` (slime reads `chunk.module.config`). CPU shims as in
tests/test_r3_mtp_replay.py, and `RoutingReplay.record`'s `pin_memory=True` dropped (CPU has no pinned allocator), slime's
`accelerator.current_device()` -> "cpu".
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLIME_GIT = Path("/work/.mirror/THUDM+slime/repo")
PATCHED = ("megatron/core/transformer/moe/router.py", "megatron/core/transformer/moe/moe_utils.py")


def _trees(tmp: Path) -> tuple[Path, Path]:
    if not SLIME_GIT.is_dir():
        pytest.skip(f"slime mirror {SLIME_GIT} not present")
    slime = tmp / "slime-src"
    slime.mkdir()
    archive = subprocess.run(["git", f"--git-dir={SLIME_GIT}", "archive", "HEAD", "slime", "docker/patch/latest"],
                             capture_output=True, check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(slime)], input=archive, check=True, timeout=60)
    import megatron
    mcore = tmp / "mcore"
    shutil.copytree(Path(megatron.__path__[0]), mcore / "megatron")
    subprocess.run(["git", "apply", *(f"--include={p}" for p in PATCHED), "-p1",
                    str(slime / "docker/patch/latest/megatron.patch")], cwd=mcore, check=True, timeout=60)
    return slime, mcore


@pytest.mark.timeout(300)
def test_slime_fill_routing_replay_with_mtp_asserts_and_the_init_hook_skips_mtp_routers(tmp_path):
    slime, mcore = _trees(tmp_path)
    env = dict(os.environ, ENABLE_ROUTING_REPLAY="1",
               PYTHONPATH=os.pathsep.join([str(mcore), str(ROOT), str(slime), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--worker"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=260)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["patched_megatron"] is True and res["replays"] == 3, res
    assert res["stock_assert_line"] == "assert routing_replay_offset == len(RoutingReplay.all_routing_replays)", res
    assert res["stock_filled"] == [1, 1, 0], res          # two decoder layers filled, the MTP router's never
    assert res["installed"] is True and res["replays_after"] == 2, res
    assert res["decoder_equal_captured"] is True and res["decoder_own_choice_differs_rows"] > 0, res
    assert res["mtp_equals_own_choice"] is True and res["stage_after"] == "replay_forward", res


def _stand_ins():
    import importlib.abc
    import importlib.machinery
    import types

    stood_in = ("megatron.training", "torch_memory_saver", "wandb")

    class Placeholder:
        def __init__(self, name):
            self._name = name

        def __getattr__(self, key):
            return Placeholder(f"{self._name}.{key}")

        def __call__(self, *a, **k):
            return Placeholder(f"{self._name}()")

    class StandInModule(types.ModuleType):
        def __getattr__(self, key):
            if key.startswith("__"):
                raise AttributeError(key)
            return Placeholder(f"{self.__name__}.{key}")

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if any(name == s or name.startswith(s + ".") for s in stood_in):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return StandInModule(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    sys.meta_path.insert(0, Finder())


def _worker():
    import socket
    import traceback
    from argparse import Namespace
    from contextlib import nullcontext
    from unittest import mock

    import numpy as np
    import torch

    _stand_ins()
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
        from megatron.core.transformer.transformer_config import TransformerConfig
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor
        from slime.backends.megatron_utils.data import DataIterator
        from slime.utils import accelerator as slime_accelerator
        from slime.utils.routing_replay import RoutingReplay

        from rollout.routed_experts import slime_replay_padding
        from rollout.routed_experts.megatron_replay import mtp_routers

        parallel_state.initialize_model_parallel(1, 1)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: nullcontext()
        torch.manual_seed(0)
        cfg = TransformerConfig(
            num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, moe_ffn_hidden_size=16,
            num_moe_experts=16, moe_router_topk=4, moe_layer_freq=[0, 1, 1], mtp_num_layers=1,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_score_function="sigmoid",
            moe_router_dtype="fp32", use_cpu_initialization=True, init_method_std=1.0, hidden_dropout=0.0,
            attention_dropout=0.0)

        class DDPStandIn(torch.nn.Module):  # stands in for megatron's DDP wrapper: slime reads .module.config
            def __init__(self, module):
                super().__init__()
                self.module = module

        cpu_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()  # noqa: E731
        empty_like = torch.empty_like
        unpinned = lambda *a, pin_memory=False, **k: empty_like(*a, **k)  # noqa: E731
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
                mock.patch.object(fused_softmax, "get_default_causal_mask", cpu_mask), \
                mock.patch.object(torch, "empty_like", unpinned), \
                mock.patch.object(slime_accelerator, "current_device", lambda: "cpu"), torch.no_grad():
            spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
            gpt = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=64,
                           mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
            names = [n for n, m in gpt.named_modules() if isinstance(m, TopKRouter)]
            routers = [gpt.get_submodule(n) for n in names]
            replays = [r.routing_replay for r in routers]
            mtp = mtp_routers(gpt)

            lengths = [9, 7]
            rng = np.random.default_rng(5)
            full = [np.zeros((t - 1, 3, 4), np.int32) for t in lengths]   # slime's all-layer rows, dense = 0
            for f in full:
                for row in f:
                    row[1:] = [rng.permutation(16)[:4] for _ in range(2)]
            rollout_data = {"rollout_routed_experts": [torch.from_numpy(f) for f in full],
                            "tokens": [torch.randint(0, 64, (t,)) for t in lengths]}
            ids = torch.cat(rollout_data["tokens"])[None]
            pos = torch.arange(ids.shape[1])[None]
            args = Namespace(num_experts=16, data_pad_size_multiplier=1, sequence_parallel=False, allgather_cp=False,
                             mtp_num_layers=1, expert_model_parallel_size=1)
            actor = Namespace(args=args, model=[DDPStandIn(gpt)])
            iters = [DataIterator(rollout_data, [[0, 1]])]

            def fill():
                MegatronTrainRayActor.fill_routing_replay(actor, iters, [1], dict(rollout_data))

            try:
                fill()
                stock_line = "passed"
            except AssertionError as e:
                stock_line = traceback.extract_tb(e.__traceback__)[-1].line
            stock_filled = [len(r.top_indices_list) for r in replays]
            RoutingReplay.clear_all()

            installed = slime_replay_padding.install(args)
            fill()
            replays_after = len(RoutingReplay.all_routing_replays)
            seen, inputs = {}, {}
            hooks = [r.register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out[1].clone()))
                     for n, r in zip(names, routers)]
            hooks.append(mtp[0].register_forward_pre_hook(lambda m, a: inputs.__setitem__("mtp", a[0].clone())))
            os.environ["ROUTING_REPLAY_STAGE"] = "replay_forward"
            gpt(ids, pos, attention_mask=None, labels=ids)      # decoder + MTP layer
            stage_after = os.environ["ROUTING_REPLAY_STAGE"]
            replayed = dict(seen)
            os.environ["ROUTING_REPLAY_STAGE"] = "fallthrough"
            mtp_own = mtp[0](inputs["mtp"])[1]
            gpt(ids, pos, attention_mask=None, labels=ids)
            own = dict(seen)
            for h in hooks:
                h.remove()
        starts = np.cumsum([0] + lengths)
        real = torch.tensor([i for k in range(len(lengths)) for i in range(starts[k], starts[k + 1] - 1)])
        captured = np.concatenate(full)
        decoder = names[:2]
        expected = [torch.zeros(len(real), 16, dtype=torch.bool).scatter(
            1, torch.from_numpy(captured[:, layer]).long(), True) for layer in (1, 2)]
        print(json.dumps({
            "patched_megatron": all(r is not None for r in replays), "replays": len(replays),
            "stock_assert_line": stock_line, "stock_filled": stock_filled, "installed": installed,
            "replays_after": replays_after, "stage_after": stage_after,
            "decoder_equal_captured": all(torch.equal(replayed[n][real], e) for n, e in zip(decoder, expected)),
            "decoder_own_choice_differs_rows": int(sum((own[n][real] != replayed[n][real]).any(1).sum()
                                                       for n in decoder)),
            "mtp_equals_own_choice": bool(torch.equal(replayed[names[2]], mtp_own)),
        }))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
