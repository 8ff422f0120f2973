"""slime's OWN training loops on real engines, one arm per request line, for benchmarks/fully_async_update.py.

Runs under SLIME_PYTHON with slime importable (`SlimeLoop` starts it). Per arm: Ray (started once), slime's
router (`_start_router`), slime's `SGLangEngine` as Ray actors attached to the benchmark's engines (external
mode, registered with the router), then slime's unmodified `train_async.train(args)` or `train.train(args)`
with slime's own `RayTrainGroup` as the actor model, so every weight update is slime's disk path
(`RayTrainGroup.update_weights` -> `_reload_rollout_weights_from_disk`: `pause_generation` with an empty body,
`flush_cache`, `update_weights_from_disk(model_path, weight_version)`, `continue_generation`, each engine).
STAND-INs where Megatron and slime's engine launcher cannot run, named so:
- `StandInTrainActor` (Megatron's train actor): `train` sleeps `train_s` (the trainer's work, CPU idle);
  `update_weights` copies the next perturbed checkpoint into slime's `--update-weight-disk-dir`, as
  Megatron's disk save writes it there.
- `StandInRolloutManager` (slime's RolloutManager actor): its generate path with slime's own helpers
  (`load_function`, `call_rollout_fn`, `validate_rollout_id_annotated`, `_convert_samples_to_train_data`),
  `get_updatable_engines_and_lock` over the engine actors, and at `dispose` a drain: no new prompts, the
  rollout function called until every group it took has come back (so no token is left in flight).
- `Prompts` (slime's RolloutDataSourceWithBuffer): the benchmark's prompt ids; `add_samples` fills the
  buffer that `get_samples` empties first.
- After a kill -9 (`kill`), slime's health monitor's bookkeeping: the dead engine leaves the updatable engines
  at once and slime's router (the DELETE slime's `SGLangEngine.shutdown` sends) `kill_notice_s` later; slime's
  next weight update waits for both.
- COUNTERS (observation only): every /generate answer's token count and finish reason, on slime's `post`
  (slime's arms) and on the manager's `EngineClient.generate` (ours); the answer is returned unchanged.
"""
import copy
import json
import os
import shutil
import signal
import sys
import threading
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TALLY = {"answers": 0, "tokens": 0, "aborted": 0, "aborted_tokens": 0, "retracted": 0}


def say(**kw):
    print("SLIME-ARM " + json.dumps(kw), flush=True)


def _count(out) -> None:
    meta = (out or {}).get("meta_info") or {} if isinstance(out, dict) else {}
    n = int(meta.get("completion_tokens") or 0)
    TALLY["answers"] += 1
    TALLY["tokens"] += n
    TALLY["retracted"] += int(meta.get("num_retractions") or 0) > 0
    if (meta.get("finish_reason") or {}).get("type") == "abort":
        TALLY["aborted"] += 1
        TALLY["aborted_tokens"] += n


def install_counters() -> None:
    """COUNTERS on the two HTTP calls that carry /generate answers in this process."""
    from slime.rollout import sglang_rollout

    from rollout.engines.client import EngineClient
    post, generate = sglang_rollout.post, EngineClient.generate

    async def counted_post(url, payload, *a, **kw):
        out = await post(url, payload, *a, **kw)
        if url.endswith("/generate"):
            _count(out)
        return out

    async def counted_generate(self, engine, body, *a, **kw):
        out = await generate(self, engine, body, *a, **kw)
        _count(out)
        return out
    sglang_rollout.post, EngineClient.generate = counted_post, counted_generate


class Prompts:
    """STAND-IN for slime's RolloutDataSourceWithBuffer (see the module doc); `handed` fresh groups given, `dry`
    the calls before `closed` that got fewer groups than asked because the prompts ran out."""

    def __init__(self, prompts, n):
        self.prompts, self.n, self.handed, self.buffer, self.closed = list(prompts), n, 0, [], False
        self.dry = 0

    def get_samples(self, k):
        from slime.utils.types import Sample
        out, self.buffer = self.buffer[:k], self.buffer[k:]
        while len(out) < k and not self.closed and self.handed < len(self.prompts):
            g = self.handed
            out.append([Sample(group_index=g, index=g * self.n + j, prompt="", tokens=list(self.prompts[g]))
                        for j in range(self.n)])
            self.handed += 1
        self.dry += len(out) < k and not self.closed
        return out

    def add_samples(self, groups):
        self.buffer += list(groups)


def _sample_row(s, first_dense: int) -> dict:
    """What the replay needs of one delivered sample (routed experts: the MoE layers of slime's array)."""
    import numpy as np
    prompt_len = len(s.tokens) - s.response_length
    rows = s.rollout_routed_experts
    rows = None if rows is None else np.asarray(rows)[:, first_dense:].tolist()
    return {"index": s.index, "prompt_ids": list(s.tokens[:prompt_len]), "response_ids": list(s.tokens[prompt_len:]),
            "logprobs": list(s.rollout_log_probs or []), "routed_experts": rows,
            "spans": (s.metadata or {}).get("weight_version_spans"), "weight_versions": list(s.weight_versions or [])}


class StandInRolloutManager:
    """STAND-IN for slime's RolloutManager actor (see the module doc)."""

    def __init__(self, args, prompts, engines, dump, first_dense):
        from slime.utils.http_utils import init_http_client
        from slime.utils.misc import load_function

        from rollout.slime import set_tokenizer
        set_tokenizer(None)   # prompts arrive as tokens
        init_http_client(args)
        install_counters()
        self.args, self.engines, self.dead = args, list(engines), set()
        self.data_source = Prompts(prompts, args.n_samples_per_prompt)
        self.fn = load_function(args.rollout_function_path)
        self.dump, self.first_dense = dump, first_dense
        self.steps, self.drained, self.delivered = [], [], []

    def get_updatable_engines_and_lock(self):
        return [e for i, e in enumerate(self.engines) if i not in self.dead], None, 0, [], [], []

    def lost(self, i):
        self.dead.add(i)

    def _call(self, rollout_id, args):
        from slime.observability.rollout_data_utils import validate_rollout_id_annotated
        from slime.rollout.base_types import call_rollout_fn
        t0 = time.time()
        out = call_rollout_fn(self.fn, args, rollout_id, self.data_source, evaluation=False)
        validate_rollout_id_annotated(out.samples)
        samples = [s for g in out.samples for s in g]
        if self.dump:
            with open(self.dump, "a") as f:
                for s in samples:
                    f.write(json.dumps(_sample_row(s, self.first_dense)) + "\n")
        self.delivered += [g[0].group_index for g in out.samples]
        metrics = {k: v for k, v in (out.metrics or {}).items() if isinstance(v, (int, float, str, type(None)))}
        return out, {"rollout_id": rollout_id, "t": [t0, time.time()],
                     "groups": [g[0].group_index for g in out.samples], "tokens": sum(s.response_length for s in samples), "metrics": metrics,
                     "answers": [len(s.weight_versions or []) for s in samples]}

    def generate(self, rollout_id):
        import itertools

        from slime.ray.rollout import RolloutManager
        out, step = self._call(rollout_id, self.args)
        mgr = object.__new__(RolloutManager.__ray_actor_class__)
        mgr.args, mgr.custom_convert_samples_to_train_data_func, mgr.custom_reward_post_process_func = \
            self.args, None, None
        train = mgr._convert_samples_to_train_data(list(itertools.chain.from_iterable(out.samples)))
        step["samples"] = len(train["tokens"])
        self.steps.append(step)
        return step

    def dispose(self, drain_s=180.0):
        """The drain (module doc); then the pool is stopped."""
        self.data_source.closed = True
        until = time.time() + drain_s
        rid = 1000
        while len(self.delivered) < self.data_source.handed and time.time() < until:
            args = copy.copy(self.args)
            args.rollout_batch_size = min(self.args.rollout_batch_size, self.data_source.handed - len(self.delivered))
            _, step = self._call(rid, args)
            self.drained.append(step)
            rid += 1
        if "fully_async_rollout" in self.args.rollout_function_path:
            from slime.rollout import fully_async_rollout
            fully_async_rollout._stop_global_worker()
        if self.args.rollout_function_path.startswith("rollout.slime"):
            from rollout.slime import fully_async
            fully_async.reset()

    def report(self):
        return {"steps": self.steps, "drained": self.drained, "handed": self.data_source.handed,
                "dry": self.data_source.dry,
                "delivered": self.delivered, "tally": dict(TALLY), "dead": sorted(self.dead)}


class StandInTrainActor:
    """STAND-IN for slime's Megatron train actor (see the module doc)."""

    def __init__(self, train_s, ckpts, disk_dir):
        self.train_s, self.ckpts, self.disk_dir, self.k, self.busy = train_s, ckpts, disk_dir, 0, []

    def set_rollout_manager(self, mgr):
        return None

    def train(self, rollout_id, rollout_data_ref, external_data=None):
        t0 = time.time()
        time.sleep(self.train_s)
        self.busy.append([rollout_id, t0, time.time()])

    def update_weights(self):
        self.k += 1
        shutil.copytree(os.path.join(self.ckpts, f"v{self.k}"), os.path.join(self.disk_dir, f"weight_v{self.k:06d}"),
                        dirs_exist_ok=True)

    def clear_memory(self):
        return None

    def log(self):
        return self.busy


def _engine_actor_cls():
    from slime.backends.sglang_utils import sglang_engine

    class EngineActor(sglang_engine.SGLangEngine):
        """slime's SGLangEngine in a Ray actor, as slime's RolloutManager creates it (`ray.remote(SGLangEngine)`)."""

        def __init__(self, *a, **kw):
            sglang_engine.accelerator.resolve_visible_device_id = int   # FAKE of slime's GPU-id mapping (CUDA)
            super().__init__(*a, **kw)
    return EngineActor


def _forget_worker(router: str, url: str) -> None:
    """What slime's SGLangEngine.shutdown sends the router for a dead engine (slime's monitor kills it)."""
    import requests
    for w in requests.get(f"{router}/workers", timeout=10).json()["workers"]:
        if w["url"] == url:
            requests.delete(f"{router}/workers/{w['id']}", timeout=10).raise_for_status()


def run_arm(ray, spec: dict) -> dict:
    import train as train_sync
    import train_async
    from check_against_slime import slime_args
    from slime.backends.sglang_utils import external
    from slime.ray.actor_group import RayTrainGroup
    from slime.ray.rollout import _start_router
    from slime.utils import http_utils

    from training_configs.schema import load_config

    loop = train_async if spec["loop"] == "train_async" else train_sync
    cfg = load_config(spec["config"])
    args = slime_args(cfg, spec["model"], spec["addrs"])
    vars(args).update(dict(
        rollout_function_path=spec["fn"], num_rollout=spec["steps"], rollout_batch_size=spec["groups"],
        over_sampling_batch_size=spec["groups"], rollout_max_response_len=spec["max_new_tokens"],
        sglang_server_concurrency=spec["concurrency"], custom_rm_path="check_against_slime.length_reward",
        use_rollout_routing_replay=spec["r3"], colocate=False, release_train=False, start_rollout_id=0,
        check_weight_update_equal=False, use_critic=False, num_critic_only_steps=0, save_interval=None,
        update_weights_interval=1, eval_interval=None, skip_eval_before_train=True, offload_train=False,
        update_weight_mode="full", update_weight_transport="disk", update_weight_disk_dir=spec["disk_dir"],
        update_weight_disk_keep_files=False, update_weight_local_checkpoint_dir=None, update_weight_start_version=0,
        slime_moe_rollout_config=spec["config"]))
    vars(args).update(spec.get("overrides") or {})
    http_utils.init_http_client(args)
    infos = external.discover_external_engines(spec["addrs"])
    args.rollout_num_gpus = sum(i.num_gpus for i in infos)
    args.sglang_router_ip, args.sglang_router_port = _start_router(args)
    router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
    engine_cls = ray.remote(num_cpus=0)(_engine_actor_cls())
    engines = []
    for rank, info in enumerate(infos):
        e = engine_cls.remote(args, rank, worker_type=info.worker_type, base_gpu_id=0,
                              num_gpus_per_engine=info.num_gpus)
        ray.get(e.init.remote(**external.external_engine_init_kwargs(info), router_ip=args.sglang_router_ip,
                              router_port=args.sglang_router_port))
        engines.append(e)
    if spec.get("direct"):   # its requests to its one engine: PyPI's sglang-router drops return_routed_experts
        host, port = spec["addrs"][0].rsplit(":", 1)
        args.sglang_router_ip, args.sglang_router_port = host, int(port)
    mgr = ray.remote(num_cpus=0)(StandInRolloutManager).remote(args, spec["prompts"], engines, spec.get("dump"),
                                                               cfg.model.first_k_dense_replace)
    actor = ray.remote(num_cpus=0)(StandInTrainActor).remote(spec["train_s"], spec["ckpts"], spec["disk_dir"])
    group = RayTrainGroup(args, 1, 1, None, role="actor")
    group._actor_handlers, group._rollout_manager = [actor], mgr
    updates, kills = [], []
    real_update = group.update_weights

    def kill(i):
        time.sleep(spec["kill_delay_s"])
        for pid in spec["kill_pids"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kills.append(time.time())
        ray.get(mgr.lost.remote(i))   # slime's next update skips it
        time.sleep(spec["kill_notice_s"])
        _forget_worker(router, f"http://{spec['addrs'][i]}")

    killer = []

    def timed_update():
        for th in killer:   # the monitor's bookkeeping is done before slime's next update
            th.join()
        t0 = time.time()
        real_update()
        updates.append([t0, time.time()])
        if spec.get("kill_after_update") is not None and len(updates) == spec["kill_after_update"] + 1:
            killer.append(threading.Thread(target=kill, args=(spec["kill_engine"],), daemon=True))
            killer[-1].start()
    group.update_weights = timed_update
    saved = {k: getattr(loop, k) for k in ("create_placement_groups", "create_rollout_manager",
                                            "create_training_models", "configure_logger", "init_tracking",
                                            "finish_tracking")}
    loop.create_placement_groups = lambda a: {"rollout": None, "actor": None, "critic": None}
    loop.create_rollout_manager = lambda a, pg: (mgr, None)
    loop.create_training_models = lambda a, pgs, m: (group, None)
    for k in ("configure_logger", "init_tracking", "finish_tracking"):
        setattr(loop, k, lambda *a, **kw: None)
    try:
        t0 = time.time()
        loop.train(args)
        t1 = time.time()
        rep = ray.get(mgr.report.remote())
        busy = ray.get(actor.log.remote())
    finally:
        for k, v in saved.items():
            setattr(loop, k, v)
        for h in [mgr, actor, *engines]:
            ray.kill(h)
    return {"arm": spec["arm"], "loop": [t0, t1], "train": busy, "updates": updates, "kills": kills, **rep}


def main() -> int:
    import ray
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"],
                                       **{k: v for k, v in os.environ.items() if k.startswith("SLIME_MOE_ROLLOUT")}}})
    import sglang
    say(ready=f"slime's loops: SGLang client {sglang.__version__}, Ray {ray.__version__}")
    for line in sys.stdin:
        spec = json.loads(line)
        try:
            say(**run_arm(ray, spec))
        except Exception as e:   # noqa: BLE001 - one line back to the benchmark
            import traceback
            traceback.print_exc()
            say(error=f"{spec['arm']}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            return 1
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import _slime_loop   # the classes by module name, so Ray's workers import them rather than pickle __main__
    sys.exit(_slime_loop.main())
