"""slime's OWN `train_async.py` loop (unmodified, `train_async.train(args)`) on
`--rollout-function-path rollout.slime.generate_rollout_fully_async`, through weight updates, on real Ray.

    PYTHONPATH=$PWD:$SLIME_SRC /tmp/venv-slime/bin/python -m pytest tests/test_slime_train_async.py

Where Megatron and SGLang cannot run here, STAND-INs, named so: `StandInActor` (the training model: records
what it trains on; `update_weights()` updates the stand-in worker's weight version, as slime's weight sync
does on the engines), `StandInRolloutManager` (a Ray actor doing what slime's `RolloutManager.generate`
does with the rollout function: slime's `load_function`, `call_rollout_fn`, `validate_rollout_id_annotated`,
the flattening and `_convert_samples_to_train_data`), and the router and versioned SGLang worker of
tests/test_slime_fully_async.py (the worker lives in this process; the rollout manager reaches it over HTTP).
slime's placement groups, tracking and logger set-up are replaced by no-ops (GPUs and wandb).

One prompt is a long tail: its first request is held from the first rollout until the second weight update in
the loop. With `max_weight_version_lag: 1` it must never reach the trainer with its old tokens; without the
bound it does (the arm that shows the check bites).
"""
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.slime_standin import REAL as SLIME_AVAILABLE

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.skipif(not SLIME_AVAILABLE, reason="slime is not importable: put a slime checkout "
                                 "(THUDM/slime 624b824) on PYTHONPATH to run slime's own train_async.py"),
              pytest.mark.timeout(420)]
PROMPTS = [[99, 1]] + [[2 * i + 1, 2 * i + 2] for i in range(1, 14)]   # the first: the long tail (HOLD)
NUM_ROLLOUT = 5


def _wandb_stub() -> str:
    """slime's logging imports wandb; nothing here calls it: a STUB package where wandb is not installed."""
    if importlib.util.find_spec("wandb") is not None:
        return ""
    stubs = tempfile.mkdtemp(prefix="wandb-stub-")
    os.makedirs(os.path.join(stubs, "wandb"))
    with open(os.path.join(stubs, "wandb", "__init__.py"), "w") as fh:
        fh.write('"""STUB: wandb is not installed; slime only imports it."""\n')
    sys.path.insert(0, stubs)
    return stubs


def _ray(stubs: str):
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        slime_src = next((p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                          if p and (Path(p) / "slime").is_dir()), "")
        path = os.pathsep.join(p for p in [str(ROOT), str(ROOT / "tests"), slime_src, stubs] if p)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    return ray


class StandInRolloutManager:
    """STAND-IN for slime's RolloutManager actor (no SGLang engines here): its `generate` path with slime's own
    helpers; `ledger()` says which prompts the data source gave out."""

    def __init__(self, args):
        from test_slime_adapter import StandInDataSource
        from slime.utils.http_utils import init_http_client
        from slime.utils.misc import load_function

        from rollout.slime import set_tokenizer
        set_tokenizer(None)   # prompts arrive as tokens
        init_http_client(args)   # as slime's RolloutManager does: slime's `post` (custom generate functions) uses it
        self.args = args
        self.data_source = StandInDataSource(PROMPTS, args.n_samples_per_prompt)
        self.generate_rollout = load_function(args.rollout_function_path)

    def generate(self, rollout_id):
        from slime.observability.rollout_data_utils import validate_rollout_id_annotated
        from slime.ray.rollout import RolloutManager
        from slime.rollout.base_types import call_rollout_fn
        with urllib.request.urlopen(self.args.worker_url + "/model_info") as r:   # what the engine serves now
            serving = json.load(r)["weight_version"]
        out = call_rollout_fn(self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)
        validate_rollout_id_annotated(out.samples)
        groups = [{"index": g[0].index, "tokens": g[0].tokens[:2], "spans": g[0].metadata["weight_version_spans"],
                   "versions": [s["version"] for x in g for s in x.metadata["weight_version_spans"]]}
                  for g in out.samples]
        data = list(itertools.chain.from_iterable(out.samples))
        mgr = object.__new__(RolloutManager.__ray_actor_class__)
        mgr.args, mgr.custom_convert_samples_to_train_data_func, mgr.custom_reward_post_process_func = \
            self.args, None, None
        train = mgr._convert_samples_to_train_data(data)
        return {"rollout_id": rollout_id, "serving": serving, "groups": groups, "metrics": out.metrics,
                "samples": len(train["tokens"])}

    def ledger(self):
        return self.data_source.k // self.args.n_samples_per_prompt

    def dispose(self):
        from rollout.slime import fully_async
        fully_async.reset()


class StandInActor:
    """STAND-IN for slime's actor model (Megatron cannot run here): trains on nothing, records each step's
    rollout; `update_weights()` is slime's weight sync as the engines see it: a new weight version."""

    def __init__(self, ray, worker):
        self.ray, self.worker, self.steps, self.updates = ray, worker, [], 0

    def update_weights(self):
        self.worker.update()
        self.updates += 1
        if self.updates == 3:   # the long tail ends two loop updates after it began
            self.worker.release()

    def async_train(self, rollout_id, rollout_data_ref):
        self.steps.append((rollout_id, rollout_data_ref))   # train_async passes what ray.get returned
        return []


def _args(router_port, worker_url, **kw):
    base = dict(sglang_router_ip="127.0.0.1", sglang_router_port=router_port, worker_url=worker_url,
                n_samples_per_prompt=2, rollout_batch_size=2, sglang_server_concurrency=4, rollout_num_gpus=1,
                rollout_num_gpus_per_engine=1, use_rollout_routing_replay=False, rollout_temperature=1.0,
                rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=4, hf_checkpoint=None,
                custom_rm_path="test_slime_adapter.length_reward", partial_rollout=False,
                rollout_function_path="rollout.slime.generate_rollout_fully_async", use_distributed_post=False,
                # train_async.train's own flags
                colocate=False, release_train=False, start_rollout_id=0, num_rollout=NUM_ROLLOUT,
                check_weight_update_equal=False, use_critic=False, num_critic_only_steps=0, save_interval=None,
                update_weights_interval=1, eval_interval=None, rollout_global_dataset=True,
                # slime's _convert_samples_to_train_data
                reward_key=None, advantage_estimator="grpo", rewards_normalization=True,
                grpo_std_normalization=True, custom_convert_samples_to_train_data_path=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _train_async(monkeypatch, stand, **kw):
    stubs = _wandb_stub()
    import train_async   # slime's own, from SLIME_SRC
    ray = _ray(stubs)
    manager_cls = ray.remote(num_cpus=1)(StandInRolloutManager)
    actor = StandInActor(ray, stand.worker)
    holder = {}

    def create_rollout_manager(args, pg):
        holder["mgr"] = manager_cls.remote(args)
        return holder["mgr"], None
    monkeypatch.setattr(train_async, "create_placement_groups", lambda args: {"rollout": None})
    monkeypatch.setattr(train_async, "create_rollout_manager", create_rollout_manager)
    monkeypatch.setattr(train_async, "create_training_models", lambda args, pgs, mgr: (actor, None))
    for name in ("configure_logger", "init_tracking", "finish_tracking"):
        monkeypatch.setattr(train_async, name, lambda *a, **k: None)
    args = _args(stand.router.port, stand.worker.url, **kw)
    try:
        train_async.train(args)
        taken = ray.get(holder["mgr"].ledger.remote())
    finally:
        if "mgr" in holder:
            ray.kill(holder["mgr"])
    assert stand.worker.expired == 0, "the long tail's requests were not held until the second loop update"
    return actor, taken


@pytest.fixture
def stand():
    from test_slime_adapter import StandInRouter
    from test_slime_fully_async import VersionedWorker
    w = VersionedWorker().start()
    w.version = "0"
    r = StandInRouter([(w.url, "regular")]).start()
    yield SimpleNamespace(worker=w, router=r)
    w.release()
    r.stop()
    w.stop()


def _stale(steps, lag):
    return [(rid, g["index"], g["versions"]) for rid, out in steps for g in out["groups"]
            if min(int(v) for v in g["versions"]) < int(out["serving"]) - lag]


def test_train_async_delivers_every_group_once_and_bounds_staleness(monkeypatch, stand):
    actor, taken = _train_async(monkeypatch, stand, max_weight_version_lag=1)
    assert [rid for rid, _ in actor.steps] == list(range(NUM_ROLLOUT)) and actor.updates == NUM_ROLLOUT + 1
    assert [out["serving"] for _, out in actor.steps] == ["1", "1", "2", "3", "4"]   # train_async's order
    delivered = [g["index"] for _, out in actor.steps for g in out["groups"]]
    assert len(delivered) == len(set(delivered)) == 2 * NUM_ROLLOUT       # every group once
    assert all(out["samples"] == 4 for _, out in actor.steps)             # slime's train data: 2 x 2 samples
    assert taken >= NUM_ROLLOUT * 2
    assert _stale(actor.steps, 1) == []                                   # the bound held
    assert sum(out["metrics"]["rollout/stale_groups"] for _, out in actor.steps) >= 1
    tail = [g for _, out in actor.steps for g in out["groups"] if g["tokens"][0] == 99]
    assert all(set(g["versions"]) == {g["versions"][-1]} for g in tail)   # regenerated: one version


def test_train_async_with_a_custom_generate_function(monkeypatch, stand):
    """The same loop with a two-turn `--custom-generate-function-path` (tests/test_slime_fully_async_custom.py's,
    posting with slime's own `post`): every group once, the long tail (its first turns held across two
    updates) regenerated, not delivered stale; each sample's spans cover its two turns, not the tool's tokens."""
    actor, _ = _train_async(monkeypatch, stand, max_weight_version_lag=1,
                            custom_generate_function_path="test_slime_fully_async_custom.two_turns")
    assert [rid for rid, _ in actor.steps] == list(range(NUM_ROLLOUT))
    delivered = [g["index"] for _, out in actor.steps for g in out["groups"]]
    assert len(delivered) == len(set(delivered)) == 2 * NUM_ROLLOUT
    assert all(out["samples"] == 4 for _, out in actor.steps)
    assert _stale(actor.steps, 1) == []
    assert sum(out["metrics"]["rollout/stale_regenerated"] for _, out in actor.steps) >= 1
    assert sum(out["metrics"]["rollout/custom_generate_requests"] for _, out in actor.steps) >= 2 * 2 * 2 * NUM_ROLLOUT
    for _, out in actor.steps:
        for g in out["groups"]:
            assert [(s["start"], s["end"]) for s in g["spans"]] == [(0, 2), (4, 6)], g


def test_train_async_without_the_bound_delivers_the_stale_group(monkeypatch, stand):
    actor, _ = _train_async(monkeypatch, stand)
    stale = _stale(actor.steps, 1)
    assert stale and stale[0][2][0] == "1", stale   # the long tail: tokens of version 1 reach the trainer
    assert all(out["metrics"]["rollout/stale_groups"] == 0 for _, out in actor.steps)
