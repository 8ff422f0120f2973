"""Real SGLang 0.5.15.post1 engines on the GPU: tp 1, `--device cuda`, Triton attention, decode CUDA
graphs, overlap scheduling, routed experts; one judged line per check (`gpu-check NAME: PASS|FAIL ...`).

Run by scripts/gpu_check/run.sh (PYTHONPATH=<site>:<repo>, the kernel shim in <site>/sitecustomize.py):
    python scripts/gpu_check/engine_checks.py --work DIR [--budget S] [--requests N]
Six engines start side by side on the one GPU (plan.engine_specs): the plugin; the plugin without
capture-snapshot; no plugin (SGLANG_PLUGINS=none); NEXTN with the plugin; two small-pool engines (the
plugin, and the plugin with retraction-rows and retraction-routes disabled) for the retraction check. The
tiny GLM-4.5 (bf16) is built locally in DIR. Exit status 1 if any check FAILs. Engine logs go to DIR/engine-NAME.log.
"""
import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]
import judges  # noqa: E402
import plan  # noqa: E402
from rollout.cli.engine import log_text, parse_active_fixes  # noqa: E402
from rollout.net import auth_headers  # noqa: E402
from sglang_patches.fixes.retraction_rows import META_KEY as RETRACTION_META  # noqa: E402
from sglang_patches.fixes.retraction_rows import SAMPLING_TIME as RETRACTION_SAMPLING_TIME  # noqa: E402

RESULTS = []
MAX_NEW = 24
LOAD_CONCURRENCY, LOAD_NEW = 16, 48
SPEED_ROUNDS = 3


def report(v: "judges.Verdict") -> None:
    RESULTS.append(v)
    print(v.line(), flush=True)


def free_ports(n: int) -> list:
    """n engine ports 10 apart with their +1 (NCCL) and +2.. (dist-init) neighbours free."""
    from rollout.engines.process import port_in_use
    from rollout.net import free_port

    out = []
    while len(out) < n:
        p = free_port()
        if all(abs(p - q) >= 10 for q in out) and not any(port_in_use("127.0.0.1", p + i) for i in range(1, 8)):
            out.append(p)
    return out


def start(specs, model, out_dir):
    """Every planned engine through the product's local backend, with the plan's CUDA command; the
    engine group (routed experts on) is preset (a)'s. Logs: OUT_DIR/engine-NAME.log."""
    from rollout import config as rconfig
    from rollout.engines.local_backend import LocalBackend

    group = rconfig.load("a").engine_groups[0]
    backend = LocalBackend(out_dir, command=lambda es: [commands[es.name]])
    engines, commands = {}, {}
    for spec, port in zip(specs, free_ports(len(specs))):
        key = secrets.token_hex(16)
        es = rconfig.EngineSpec(f"engine-{spec.name}", group, 0, "127.0.0.1", port, key, model, device="cuda")
        commands[es.name] = plan.engine_command(spec, model, port, key)
        engines[spec.name] = backend.start(es)
        if spec is specs[0]:
            print(f"  engine command ({spec.name}): {commands[es.name].shell()}", flush=True)
    return engines


def tail(eng, n=40) -> str:
    return "\n".join(eng.log_tail(n))


def wait_all(engines, specs, budget) -> dict:
    """{name: ready seconds or error text}; every engine is polled until ready, dead or out of time."""
    import requests

    state = {}
    deadline = budget.clock() + max(30.0, budget.left() - 120)
    while len(state) < len(engines):
        for name, eng in engines.items():
            if name in state:
                continue
            if not eng.alive():
                state[name] = f"{eng.exit_reason()}:\n{tail(eng)}"
                continue
            try:
                if requests.get(eng.url + "/health", headers=auth_headers(eng.api_key), timeout=3).status_code == 200:
                    state[name] = time.monotonic() - eng.started_at
            except requests.RequestException:
                pass
        if budget.clock() > deadline:
            for name, eng in engines.items():
                state.setdefault(name, f"not ready within the budget:\n{tail(eng)}")
        budget.tick("engines starting (" + ", ".join(f"{n} {'up' if isinstance(state.get(n), float) else '...'}"
                                                   for n in engines) + ")")
        time.sleep(1.0)
    for spec in specs:
        s = state[spec.name]
        report(judges.judge_engine_up(spec.name, s if isinstance(s, float) else None,
                                    None if isinstance(s, float) else s))
    return state


def prompts(n: int, seed: int = 0) -> list:
    import random

    from rollout.models.tiny import SPECIALS, VOCAB

    rng = random.Random(seed)
    regular = list(range(len(SPECIALS), VOCAB))
    return [[rng.choice(regular) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def ask(eng, ids, n):
    import requests

    from rollout.routed_experts.codec import decode_int32
    from rollout.models.tiny import NUM_LAYERS, TOP_K

    body = {"input_ids": list(ids), "return_routed_experts": eng.spec.group.routed_experts,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    seq = list(ids) + out["output_ids"][:-1]  # SGLang reports P+O-1 rows: the last token is never forwarded
    routed = decode_int32(out["meta_info"]["routed_experts"]).reshape(-1, NUM_LAYERS, TOP_K).tolist()
    return {"seq": seq, "routed": routed, "out": len(out["output_ids"]),
            "weight_version": out["meta_info"].get("weight_version")}


class Router:
    """transformers' router on the GPU (fp32): {moe layer: [sorted experts per token]} per sequence.
    The tests' reference (rollout/models/reference.py hf_router_topk) with the model on `device`, for both layouts:
    transformers 5.12.1 (SGLang 0.5.15.post1's pin, carried) routes in the MoE block's
    `route_tokens_to_experts`; newer releases' router returns (logits, weights, indices)."""

    def __init__(self, model_path: str, device: str = "cuda"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        self.m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
        self.cache = {}

    @staticmethod
    def _tap(mlp, i, cap):
        if hasattr(mlp, "route_tokens_to_experts"):
            orig = mlp.route_tokens_to_experts

            def routed(logits):
                out = orig(logits)
                cap[i] = out[0]
                return out

            mlp.route_tokens_to_experts = routed
            return lambda: delattr(mlp, "route_tokens_to_experts")
        return mlp.gate.register_forward_hook(lambda mod, a, out: cap.__setitem__(i, out[2])).remove

    def __call__(self, seq) -> dict:
        key = tuple(seq)
        if key not in self.cache:
            cap, undo = {}, []
            for i, layer in enumerate(self.m.model.layers):
                if hasattr(layer.mlp, "gate"):
                    undo.append(self._tap(layer.mlp, i, cap))
            try:
                with self.torch.no_grad():
                    self.m(self.torch.tensor([list(seq)], device=self.device))
            finally:
                for u in undo:
                    u()
            self.cache[key] = {i: [sorted(r) for r in t.tolist()] for i, t in cap.items()}
        return self.cache[key]


def check_routed(name, eng, router, n_req):
    if router is None:
        raise RuntimeError("no transformers reference (see above)")
    recs = [ask(eng, ids, MAX_NEW) for ids in prompts(n_req, seed=1)]  # one at a time: decode graphs bs 1
    res = judges.routed_mismatches(recs, {tuple(r["seq"]): router(r["seq"]) for r in recs})
    report(judges.judge_routed(name, n_req, res))


def load(eng, ids_list, n):
    with ThreadPoolExecutor(len(ids_list)) as ex:
        return list(ex.map(lambda ids: ask(eng, ids, n), ids_list))


def check_snapshot(engines, router):
    if router is None:
        raise RuntimeError("no transformers reference (see above)")
    batch = prompts(LOAD_CONCURRENCY, seed=2)
    res = {}
    for name in ("no-snapshot", "plugin"):
        recs = []
        for _ in range(2):
            recs += load(engines[name], batch, LOAD_NEW)
        res[name] = judges.routed_mismatches(recs, {tuple(r["seq"]): router(r["seq"]) for r in recs})
    report(judges.judge_snapshot(res["no-snapshot"], res["plugin"]))


def check_speed(engines):
    batch = prompts(LOAD_CONCURRENCY, seed=3)
    tps = {"plugin": [], "no-plugin": []}
    for name in tps:  # warm-up round each
        load(engines[name], batch, 8)
    for _ in range(SPEED_ROUNDS):
        for name in tps:
            t0 = time.perf_counter()
            recs = load(engines[name], batch, LOAD_NEW)
            tps[name].append(sum(r["out"] for r in recs) / (time.perf_counter() - t0))
    report(judges.judge_speed(tps["plugin"], tps["no-plugin"]))


def stream(eng, ids, n):
    """One greedy streamed request with `min_new_tokens` (SGLang retracts it under KV pressure instead of
    reserving its budget, as `ignore_eos` would): its rows, and its output tokens before its first retraction."""
    import requests

    from rollout.models.tiny import NUM_LAYERS, TOP_K
    from rollout.routed_experts.codec import decode_int32

    body = {"input_ids": list(ids), "stream": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0}}
    chunks = []
    with requests.post(eng.url + "/generate", headers=auth_headers(eng.api_key), json=body, stream=True,
                       timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    last = chunks[-1]
    routed = decode_int32(last["meta_info"]["routed_experts"]).reshape(-1, NUM_LAYERS, TOP_K).tolist()
    return {"prompt": len(ids), "output_ids": last["output_ids"], "routed": routed, "meta_info": last["meta_info"],
            "pre": judges.pre_retraction_tokens(chunks), "rule": last["meta_info"].get(RETRACTION_META)}


def check_retraction(engines, n_req=plan.RETRACT_REQUESTS, new=plan.RETRACT_NEW):
    """retraction-rows / retraction-routes on CUDA: the small-pool engines (plan.RETRACT_FIELDS) with the fixes
    and with them disabled, side by side, the same concurrent requests; the reference is the plugin engine
    (a pool that holds them all), one request at a time."""
    from rollout.models.tiny import NUM_LAYERS
    from rollout.routed_experts.retraction import retraction_reason

    batch = prompts(n_req, seed=4)
    arms = ("retract", "retract-off")
    with ThreadPoolExecutor(len(arms) * len(batch)) as ex:
        futs = {a: [ex.submit(stream, engines[a], ids, new) for ids in batch] for a in arms}
        runs = {a: [f.result() for f in fs] for a, fs in futs.items()}
    ref = [stream(engines["plugin"], ids, new) for ids in batch]
    if any(r["pre"] is not None for r in ref):
        raise RuntimeError("the reference engine retracted a request")
    layers = range(1, NUM_LAYERS)  # the MoE layers (layer 0 is dense)
    got = {a: judges.retraction_rows(runs[a], ref, layers) for a in arms}
    version = ask(engines["retract-off"], batch[0], 1)["weight_version"]  # the engine's, as the dispatcher sends
    refused = sum(retraction_reason(o["meta_info"], version) is not None for o in runs["retract-off"])
    print(f"  retraction: {json.dumps(got)}", flush=True)
    report(judges.judge_retraction(got["retract"], got["retract-off"], refused, RETRACTION_SAMPLING_TIME))


def check_status(eng, spec):
    env = {**os.environ, **plan.ENGINE_ENV, **spec.env}  # the engine's interpreter and environment
    p = subprocess.run([sys.executable, "-m", "rollout.cli", "patches", "status"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    print("  " + "\n  ".join((p.stdout + p.stderr).strip().splitlines()), flush=True)
    report(judges.judge_status(p.returncode, p.stdout, parse_active_fixes(log_text(eng))))


def guarded(name, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - a crash of one check is that check's FAIL
        report(judges.Verdict(name, False, f"harness: {type(e).__name__}: {str(e)[-600:]}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for the tiny model and the engine logs")
    ap.add_argument("--budget", type=float, default=265.0, help="seconds for everything here")
    ap.add_argument("--requests", type=int, default=8, help="requests of the routed-experts checks")
    args = ap.parse_args(argv)
    budget = judges.Budget(args.budget)
    from rollout.models.tiny import build_tiny_glm

    t0 = time.time()
    model = build_tiny_glm(os.path.join(args.work, "tiny-glm45"), variant="random")
    print(f"  tiny GLM-4.5 (bf16) built in {time.time() - t0:.1f} s at {model}", flush=True)
    specs = plan.engine_specs()
    engines = start(specs, model, args.work)
    try:
        state = wait_all(engines, specs, budget)
        up = {n for n, s in state.items() if isinstance(s, float)}
        for spec in specs:
            if spec.name in up:
                report(judges.judge_graphs(spec.name, spec.kind, log_text(engines[spec.name])))
                calls = judges.substitute_calls(log_text(engines[spec.name]))
                print(f"  kernels[{spec.name}]: substitute ops called: {', '.join(calls) or 'none'}", flush=True)
        try:
            router = Router(model)
        except Exception as e:  # noqa: BLE001 - the routed checks then FAIL with this reason
            print(f"  transformers' model did not load on the GPU: {type(e).__name__}: {e}", flush=True)
            router = None
        steps = [("routed_experts[plugin]", {"plugin"}, check_routed, ("plugin", engines["plugin"], router, args.requests)),
                 ("routed_experts[nextn]", {"nextn"}, check_routed, ("nextn", engines["nextn"], router, args.requests)),
                 ("capture_snapshot_engine", {"plugin", "no-snapshot"}, check_snapshot, (engines, router)),
                 ("retraction_engine", {"plugin", "retract", "retract-off"}, check_retraction, (engines,)),
                 ("plugin_speed", {"plugin", "no-plugin"}, check_speed, (engines,)),
                 ("patches_status", {"plugin"}, check_status, (engines["plugin"], specs[0]))]
        for name, needs, fn, fargs in steps:
            if needs - up:
                report(judges.Verdict(name, False, f"engine(s) {', '.join(sorted(needs - up))} did not start"))
            elif budget.left() < 20:
                report(judges.Verdict(name, False, f"out of budget ({budget.elapsed():.0f} s used)"))
            else:
                guarded(name, fn, *fargs)
            budget.tick(f"after {name}")
    finally:
        for eng in engines.values():
            eng.stop()
    print(f"  engine checks: {sum(v.ok for v in RESULTS)} of {len(RESULTS)} PASS in {budget.elapsed():.0f} s",
          flush=True)
    print("gpu-check engine-summary: " + json.dumps({v.name: "PASS" if v.ok else "FAIL" for v in RESULTS}))
    return 1 if any(not v.ok and not v.skip for v in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
