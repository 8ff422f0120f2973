"""slime's OWN client code against engines started by `slime-moe-rollout serve` (driver of
scripts/check_against_slime.sh; run with a Python whose SGLang slime supports, slime on PYTHONPATH).

    python scripts/check_against_slime.py CONFIG MODEL_PATH HOST:PORT [HOST:PORT ...]

1. managed mode: slime's `discover_external_engines`, slime's router (`_start_router`), and one
   `SGLangEngine` per address running slime's `init` -> `_init_external` (server-args comparison,
   router registration); then slime's own `generate_rollout` through that router and slime's
   `_convert_samples_to_train_data` (R3 validation) on its output (no routed experts there is a [GAP] of
   slime's path: the router build must forward return_routed_experts);
2. plugin mode: `rollout.slime.generate_rollout` sends to the workers slime's router lists; its output
   must carry routed experts, pass slime's conversion (R3 validation) and slime's replay preparation
   (`prepare_routed_experts_for_routing_replay`, megatron-core on gloo, in a subprocess), and equal
   transformers' router top-k on the same tokens; the engines must have sent compact routed experts;
   every group must have run on one (engine, DP rank) (group placement, the manager's default);
   then again with SLIME_MOE_ROLLOUT_COMPACT_TRAINER=1: slime holds compact uint8 tensors, its own
   validation and replay preparation (with `rollout.routed_experts.slime_compact.install`) pass; each
   rollout step's peak host memory (slime's own vs the adapter's, same engines) is printed;
3. the eval path: `rollout.slime.generate_rollout(..., evaluation=True)` runs slime's eval rollout.
slime's argument parser needs Megatron; `args` is a namespace with slime's defaults for what these
functions read. The data source is a STAND-IN (slime's needs a prompt file and its buffer).
Prints one line per step ([ok] / [FAILED] / [GAP] for what this environment cannot show); exits 1 on
the first failure.
"""
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace


GAPS: list = []


async def length_reward(args, sample):
    return float(sample.response_length)


class DataSource:
    """STAND-IN for slime's RolloutDataSource: text prompts, numbered as slime numbers them."""

    def __init__(self, prompts, n):
        self.prompts, self.n, self.i, self.k = list(prompts), n, 0, 0

    def get_samples(self, k):
        from slime.utils.types import Sample
        out = []
        for _ in range(k):
            p = self.prompts[self.i % len(self.prompts)]
            out.append([Sample(group_index=self.i, index=self.k + j, prompt=p) for j in range(self.n)])
            self.i, self.k = self.i + 1, self.k + self.n
        return out

    def add_samples(self, groups):
        pass


def slime_args(cfg, model_path, addrs):
    from training_configs.render import slime_args as render
    argv = render(cfg, "managed", addrs)
    g, m, r = cfg.engine_groups[0], cfg.model, cfg.rollout
    return SimpleNamespace(
        hf_checkpoint=model_path, rollout_external=True, rollout_external_engine_addrs=addrs,
        num_gpus_per_node=int(argv[argv.index("--num-gpus-per-node") + 1]),
        rollout_num_gpus_per_engine=g.gpus_per_engine, rollout_num_engines=len(addrs), sglang_pp_size=g.pp,
        sglang_dp_size=g.dp, sglang_ep_size=g.ep, seed=1234, offload_rollout=False, fp16=False,
        use_rollout_routing_replay=g.routed_experts, num_layers=m.num_layers, moe_router_topk=m.topk,
        num_experts=m.num_experts, sglang_router_ip=None,
        moe_layer_freq=[0] * m.first_k_dense_replace + [1] * (m.num_layers - m.first_k_dense_replace),
        sglang_router_port=None,
        sglang_router_request_timeout_secs=3600, sglang_server_concurrency=r.concurrency_per_engine,
        use_distributed_post=False, rollout_global_dataset=True, n_samples_per_prompt=r.n_samples_per_prompt,
        rollout_batch_size=2, over_sampling_batch_size=2, rollout_temperature=r.sampling.temperature,
        rollout_top_p=r.sampling.top_p, rollout_top_k=r.sampling.top_k, rollout_max_response_len=8,
        rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False, rollout_seed=42,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False, group_rm=False,
        custom_rm_path="check_against_slime.length_reward", custom_generate_function_path=None,
        dynamic_sampling_filter_path=None, rollout_sample_filter_path=None, rollout_all_samples_process_path=None,
        rollout_sample_hook_path=None, ci_test=False, sglang_speculative_algorithm=None,
        reward_key=None, eval_reward_key=None, advantage_estimator="grpo", rewards_normalization=True,
        grpo_std_normalization=True, custom_convert_samples_to_train_data_path=None, eval_datasets=[],
        eval_max_prompt_len=None, multimodal_keys=None, apply_chat_template=False,
        apply_chat_template_kwargs=None, eval_min_new_tokens=None, sglang_enable_deterministic_inference=False)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_data(args, samples, plugin=False):
    """slime's _get_rollout_data checks and _convert_samples_to_train_data (R3 validation under R3)."""
    from slime.observability.rollout_data_utils import validate_rollout_id_annotated
    from slime.ray.rollout import RolloutManager
    validate_rollout_id_annotated(samples)
    while isinstance(samples[0], list):
        samples = list(itertools.chain.from_iterable(samples))
    mgr = object.__new__(RolloutManager.__ray_actor_class__)
    mgr.args, mgr.custom_convert_samples_to_train_data_func, mgr.custom_reward_post_process_func = args, None, None
    data = mgr._convert_samples_to_train_data(samples)
    re = data.get("rollout_routed_experts") or []
    if args.use_rollout_routing_replay and not re:
        if plugin:
            raise AssertionError(f"no routed experts in plugin mode: {[s.metadata for s in samples][:2]}")
        GAPS.append("no routed experts reached slime's OWN generate_rollout: slime's router forwarded /generate "
                    "without return_routed_experts (every PyPI sglang-router, 0.1.9-0.3.2, drops it: "
                    "scripts/probe_router_fields.py; slime's image installs zhuzilin/sgl-router's "
                    "0.3.2-9daabcd wheel from GitHub releases, which is not on PyPI)")
        print(f"[GAP] {GAPS[-1]}", flush=True)
    return data, (f"{len(samples)} samples, status {sorted({s.status.value for s in samples})}, rollout_ids "
                  f"{data['rollout_ids']}, response_lengths {data['response_lengths']}, routed experts "
                  f"{[tuple(x.shape) for x in re][:2]}")


def _blob(data, compact_args=None) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"experts": [x.tolist() for x in data["rollout_routed_experts"]], "tokens": data["tokens"],
                   "compact": compact_args}, fh)
    return fh.name


def _child(argv) -> dict:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    if proc.returncode:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def replay(data, compact_args=None):
    """slime's prepare_routed_experts_for_routing_replay on the converted data (scripts/slime_replay_worker.py:
    megatron-core parallel state on gloo, one rank; `compact_args`: with slime_compact.install)."""
    path = _blob(data, compact_args)
    res = _child([sys.executable, os.path.join(ROOT, "scripts", "slime_replay_worker.py"), path])
    os.unlink(path)
    rows = sum(len(t) for t in data["tokens"])
    if res["shape"][0] != rows or not res["equal_to_captured"]:
        raise AssertionError(f"replay tensor {res} for {rows} token rows")
    if compact_args and "not enough values to unpack" not in res["unhooked"]:
        raise AssertionError(f"slime's own preparation took the compact tensors unhooked: {res['unhooked']}")
    return f"replay tensor {res['shape']}, equal to the captured rows" + (
        f" (without the trainer-side install: {res['unhooked'][:60]})" if compact_args else "")


VERSUS_HF = """
import json, sys
from rollout.models.reference import hf_router_topk
blob = json.load(open(sys.argv[2]))
bad, rows = [], 0
for tokens, re in zip(blob["tokens"], blob["experts"]):
    for layer, want in hf_router_topk(sys.argv[1], tokens[:-1]).items():
        if [sorted(r[layer]) for r in re] != want:
            bad.append(layer)
    rows += len(tokens) - 1
print(json.dumps({"rows": rows, "bad_layers": sorted(set(bad))}))
"""


def versus_transformers(model_path, data):
    """Every MoE layer's routed experts equal transformers' router top-k on the same tokens (run with this
    project's venv: the transformers rollout.models.reference uses)."""
    path = _blob(data)
    res = _child([os.path.join(ROOT, ".venv", "bin", "python"), "-c", VERSUS_HF, model_path, path])
    os.unlink(path)
    if res["bad_layers"]:
        raise AssertionError(f"MoE layers {res['bad_layers']} differ from transformers' router")
    return f"{res['rows']} token rows, every MoE layer"


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(key)) / 1024


def measured(peaks: dict, name: str, fn):
    """Run `fn`; peaks[name] = its peak RSS (VmHWM, reset first) over the RSS it started with, MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mib("VmRSS:")
    out = fn()
    peaks[name] = _status_mib("VmHWM:") - base
    return out


def step(name, fn):
    try:
        print(f"[ok] {name}: {fn()}", flush=True)
    except Exception as e:
        print(f"[FAILED] {name}: {type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}", flush=True)
        sys.exit(1)


def attach_slime(args, addrs) -> list:
    """slime's own start-up against external engines: `discover_external_engines`, slime's router
    (`_start_router`), one `SGLangEngine.init` per engine (server-args check, router registration), until the
    router lists them all. Sets args.sglang_router_ip/port and rollout_num_gpus; returns the engine infos."""
    import httpx
    from slime.backends.sglang_utils import external, sglang_engine
    from slime.ray.rollout import _start_router
    from slime.utils import http_utils

    http_utils.init_http_client(args)
    infos = []
    step("discover_external_engines (GET /server_info, no key)",
         lambda: [(i.url, i.worker_type, i.num_gpus) for i in infos.extend(external.discover_external_engines(addrs))
                  or infos])
    args.rollout_num_gpus = sum(i.num_gpus for i in infos)
    def router():
        args.sglang_router_ip, args.sglang_router_port = _start_router(args)
        return f"{args.sglang_router_ip}:{args.sglang_router_port}"
    step("slime's router (_start_router)", router)
    # FAKE of slime's GPU-id mapping only (it needs a CUDA device); base_gpu_id is a skipped field
    sglang_engine.accelerator.resolve_visible_device_id = int
    engines = []

    def attach():
        for rank, info in enumerate(infos):
            e = sglang_engine.SGLangEngine(args, rank, worker_type=info.worker_type, base_gpu_id=0,
                                           num_gpus_per_engine=info.num_gpus)
            e.init(**external.external_engine_init_kwargs(info), router_ip=args.sglang_router_ip,
                   router_port=args.sglang_router_port)
            engines.append(e)
        return [f"rank {e.rank}: node_rank {e.node_rank}" for e in engines]
    step("SGLangEngine.init x %d (server-args check, router registration)" % len(infos), attach)
    router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"

    def registered():   # the router adds workers in the background (POST /workers answers 202)
        for _ in range(60):
            urls = [w["url"] for w in httpx.get(router + "/workers", timeout=30).json()["workers"]]
            if len(urls) >= len(infos):
                return urls
            time.sleep(0.5)
        raise AssertionError(f"slime's router lists {urls}, not the {len(infos)} engines slime registered")
    step("router /workers (every engine registered)", registered)
    return infos


def main(config, model_path, addrs):
    from slime.rollout import sglang_rollout

    from rollout.slime import generate_rollout
    from training_configs.schema import load_config

    args = slime_args(load_config(config), model_path, addrs)
    infos = attach_slime(args, addrs)
    prompts = ["the quick brown fox", "rollout routing replay records experts", "one two three"]
    out = {}
    peaks = {}
    step("slime's own generate_rollout (managed mode, through slime's router)",
         lambda: train_data(args, measured(peaks, "slime", lambda: sglang_rollout.generate_rollout(
             args, 0, DataSource(prompts, 2))).samples)[1])
    os.environ["SLIME_MOE_ROLLOUT_CONFIG"] = config

    def plugin():
        res = measured(peaks, "adapter", lambda: generate_rollout(args, 1, DataSource(prompts, 2)))
        out["p"], line = train_data(args, res.samples, plugin=True)
        compact = res.metrics.get("rollout/compact_routed_engines")
        if args.use_rollout_routing_replay and compact != len(infos):
            raise AssertionError(f"compact routed experts on {compact} of {len(infos)} engines (plugin feature off?)")
        placed, groups = res.metrics.get("rollout/groups_on_one_rank"), res.metrics["rollout/groups"]
        if placed != groups:
            raise AssertionError(f"{placed} of {groups} groups on one (engine, DP rank) (group placement off?)")
        return f"{line}; compact wire on {compact} engine(s); group placement: {placed} of {groups} groups on one " \
               "(engine, DP rank)"
    step("rollout.slime.generate_rollout -> the workers slime's router lists (plugin mode), slime's conversion "
         "+ R3 validation", plugin)
    step("rollout step's peak host memory over its start (VmHWM), same engines",
         lambda: f"slime's generate_rollout {peaks['slime']:.1f} MiB, the adapter's {peaks['adapter']:.1f} MiB "
                 "(tiny model: routed experts are a few KiB; slime's arm got none through its router)")
    step("slime's replay preparation on plugin mode's routed experts", lambda: replay(out["p"]))
    step("plugin mode's routed experts == transformers' router top-k", lambda: versus_transformers(model_path,
                                                                                                 out["p"]))
    def compact_trainer():
        from rollout.routed_experts import slime_compact
        os.environ[slime_compact.ENV] = "1"
        try:
            data, line = train_data(args, generate_rollout(args, 2, DataSource(prompts, 2)).samples, plugin=True)
        finally:
            os.environ.pop(slime_compact.ENV)
        dtypes = sorted({str(x.dtype) for x in data["rollout_routed_experts"]})
        if dtypes != ["torch.uint8"]:
            raise AssertionError(f"slime holds {dtypes}, not compact uint8")
        keys = ("num_layers", "moe_layer_freq", "num_experts", "moe_router_topk")
        return f"{line}, {dtypes[0]}; {replay(data, {k: getattr(args, k) for k in keys})}"
    if args.use_rollout_routing_replay:
        step("compact until replay (SLIME_MOE_ROLLOUT_COMPACT_TRAINER=1): slime's conversion + R3 validation, "
             "slime's replay preparation", compact_trainer)
    step("rollout.slime.generate_rollout(evaluation=True) -> slime's eval rollout", lambda: eval_step(args, prompts))
    from rollout.slime import reset
    reset()


def eval_step(args, prompts):
    from slime.utils.eval_config import EvalDatasetConfig

    from rollout.slime import generate_rollout
    path = os.path.join(tempfile.mkdtemp(), "eval.jsonl")
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"prompt": p, "label": ""}) + "\n" for p in prompts)
    args.eval_datasets = [EvalDatasetConfig(name="tiny", path=path, input_key="prompt", label_key="label",
                                            max_response_len=4, n_samples_per_eval_prompt=1, temperature=0.0,
                                            top_p=1.0, top_k=-1, custom_rm_path="check_against_slime.length_reward")]
    out = generate_rollout(args, 0, None, evaluation=True)
    d = out.data["tiny"]
    return f"{type(out).__name__}: rewards {d['rewards']}, truncated {d['truncated']}"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
