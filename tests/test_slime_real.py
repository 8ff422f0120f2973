"""slime's OWN downstream code on the adapter's output (runs only with slime importable).

    PYTHONPATH=$PWD:$SLIME_SRC python -m pytest tests/test_slime_real.py

slime needs its client-side deps (ray, pylatexenc, and wandb, which slime imports at module level);
scripts/check_against_slime.sh documents the environment. The adapter runs against the stand-in router
of test_slime_adapter.py; its `RolloutFnTrainOutput` then goes through slime's `_get_rollout_data`
checks (`validate_rollout_id_annotated`), `RolloutManager._convert_samples_to_train_data` (which runs
`validate_rollout_routed_experts_for_replay` under R3), `build_dp_schedule`, and, in a subprocess with
megatron-core's parallel state on gloo, `prepare_routed_experts_for_routing_replay`.
"""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_slime_adapter import router  # noqa: F401 - the stand-in router fixture

from support.slime_standin import REAL as SLIME_AVAILABLE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.skipif(not SLIME_AVAILABLE, reason="slime is not importable: put a slime checkout "
                                 "(THUDM/slime 624b824) on PYTHONPATH to run slime's own downstream code"),
              pytest.mark.timeout(240)]


def _slime_rollout_module():
    try:
        import slime.ray.rollout as r
    except ImportError as e:
        pytest.skip(f"slime.ray.rollout not importable here: {e}")
    return r


def _rollout(router_port, **kw):
    from test_slime_adapter import StandInDataSource, _args

    from rollout.slime import adapter
    adapter.reset()
    adapter.set_tokenizer(None)
    args = _args(router_port, rollout_batch_size=4, **kw)
    base = dict(reward_key=None, advantage_estimator="grpo", rewards_normalization=True,
                grpo_std_normalization=True, global_batch_size=8, micro_batch_size=1,
                use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False,
                custom_convert_samples_to_train_data_path=None)
    for k, v in base.items():
        setattr(args, k, v)
    src = StandInDataSource([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12, 13]], 2)
    out = adapter.generate_rollout(args, 7, src)
    return args, out


def _train_data(r, args, out):
    from slime.observability.rollout_data_utils import validate_rollout_id_annotated
    data = out.samples
    validate_rollout_id_annotated(data)
    while isinstance(data[0], list):                      # slime's _get_rollout_data flattening
        data = list(itertools.chain.from_iterable(data))
    mgr = object.__new__(r.RolloutManager.__ray_actor_class__)
    mgr.args, mgr.custom_convert_samples_to_train_data_func, mgr.custom_reward_post_process_func = args, None, None
    return mgr._convert_samples_to_train_data(data)


def test_train_data_and_dp_schedule(router):
    r = _slime_rollout_module()
    from slime.utils.dp_schedule import build_dp_schedule
    args, out = _rollout(router.port)
    train = _train_data(r, args, out)                    # runs slime's R3 validation too
    parts, _, nmb, gbs = build_dp_schedule(              # asserts num_rollouts >= global_batch_size
        args, {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1},
        [len(t) for t in train["tokens"]], global_batch_size=8, rollout_indices=train["rollout_ids"])
    assert sorted(sum(parts, [])) == list(range(8)) and gbs == [8]
    assert train["rollout_ids"] == list(range(8))        # 8 executions, 8 rollout ids
    assert [len(x) for x in train["loss_masks"]] == train["response_lengths"]
    assert all(tuple(x.shape)[1:] == (3, 4) for x in train["rollout_routed_experts"])


def test_replay_preparation(router, tmp_path):
    r = _slime_rollout_module()
    args, out = _rollout(router.port)
    train = _train_data(r, args, out)
    blob = tmp_path / "routes.json"
    blob.write_text(json.dumps({"experts": [x.tolist() for x in train["rollout_routed_experts"]],
                                "tokens": train["tokens"]}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "slime_replay_worker.py"), str(blob)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = sum(len(t) for t in train["tokens"])          # one pad row per sample replaces the missing last row
    assert res["shape"] == [rows, 3, 4] and res["equal_to_captured"] is True


def test_compact_until_replay_passes_slimes_own_validation(router, monkeypatch, capsys):
    """SLIME_MOE_ROLLOUT_COMPACT_TRAINER=1: the rollout-side wrapper goes around slime's own R3 validation
    (defined in slime.observability.rollout_data_utils, called by name from slime.ray.rollout), so slime
    holds compact uint8 tensors and its conversion validates each sample expanded."""
    r = _slime_rollout_module()
    from rollout.routed_experts import slime_compact
    monkeypatch.setenv(slime_compact.ENV, "1")
    args, out = _rollout(router.port)
    err = capsys.readouterr().err
    assert "routed experts handed to slime as int32" not in err, err
    train = _train_data(r, args, out)
    assert {str(x.dtype) for x in train["rollout_routed_experts"]} == {"torch.uint8"}
    assert all(x.shape[1] == 2 * 4 for x in train["rollout_routed_experts"])   # 2 MoE layers x top-4


def test_sample_hooks_and_dynamic_filter_are_slimes(router, monkeypatch):
    from slime.rollout.sample_hooks import set_current_rollout_id
    set_current_rollout_id(7)
    _SEEN.clear()
    args, out = _rollout(router.port, rollout_sample_hook_path=[f"{__name__}.mark_hook"],
                         dynamic_sampling_filter_path=f"{__name__}.drop_first_prompt", over_sampling_batch_size=4)
    assert all(s.metadata.get("hooked_in_rollout") == 7 for g in out.samples for s in g)
    assert out.metrics["rollout/dynamic_filter/drop_first"] == 1
    assert [1, 2, 3] not in [g[0].tokens[:3] for g in out.samples] and len(out.samples) == 4


def test_evaluation_returns_slimes_eval_output(router, tiny_model, tmp_path):
    """slime's default --eval-function-path is the rollout function: evaluation=True runs slime's eval."""
    from slime.utils import http_utils
    from slime.utils.eval_config import EvalDatasetConfig

    from rollout.slime import RolloutFnEvalOutput, generate_rollout
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": ""}) + "\n" for p in ("a b c", "d e")))
    args, _ = _rollout(router.port)
    for k, v in dict(hf_checkpoint=tiny_model, rollout_global_dataset=True, rollout_num_engines=1,
                     use_distributed_post=False, eval_max_prompt_len=None, multimodal_keys=None,
                     apply_chat_template=False, apply_chat_template_kwargs=None, eval_min_new_tokens=None,
                     eval_reward_key=None, ci_test=False, sglang_dp_size=1, rollout_stop=None,
                     rollout_stop_token_ids=None, rollout_skip_special_tokens=False, group_rm=False,
                     custom_generate_function_path=None, rollout_sample_hook_path=None,
                     mask_offpolicy_in_partial_rollout=False, sglang_speculative_algorithm=None).items():
        setattr(args, k, v)
    args.eval_datasets = [EvalDatasetConfig(name="tiny", path=str(data), input_key="prompt", label_key="label",
                                            max_response_len=3, n_samples_per_eval_prompt=2, temperature=0.0,
                                            top_p=1.0, top_k=-1)]
    http_utils.init_http_client(args)
    out = generate_rollout(args, 3, None, evaluation=True)
    assert isinstance(out, RolloutFnEvalOutput) and list(out.data) == ["tiny"]
    d = out.data["tiny"]
    assert d["rewards"] == [3.0] * 4 and d["truncated"] == [True] * 4 and len(d["samples"]) == 4


_SEEN: list = []


def mark_hook(args, sample, rollout_id=None, evaluation=None):
    sample.metadata["hooked_in_rollout"] = rollout_id
    assert evaluation is False


def drop_first_prompt(args, group):
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    return DynamicFilterOutput(keep=group[0].tokens[:3] != [1, 2, 3], reason="first")

