"""Weight updates under slime's own training loops: our fully-async rollout vs slime's, side by side in one run.

Real CPU SGLang engines (training_configs/near-tie-cpu.yaml: the near-tie tiny GLM-4.5, routed experts on, the
plugin on), slime's unmodified `train_async.py` / `train.py` loops with slime's own `RayTrainGroup` updating
the engines from disk at every step (pause with an empty body, flush, `update_weights_from_disk` of a perturbed
checkpoint with a new `weight_version`, continue), slime's router and `SGLangEngine` actors; STAND-INs only
where Megatron and slime's launcher cannot run (benchmarks/_slime_loop.py says which). Each version's checkpoint
is the near-tie model with its router weights perturbed (`--perturb`, seeded by the version): every update
changes the routing. Arms (same prompts, sampling, `--steps`, `--groups` of 2 samples, the stand-in's training
per step, `--concurrency` per engine). The training per step is `--train-frac` of the sync arm's generation per
step (its calls after the first; `--train-s` sets it instead): shorter than generation, as where generation is
the bottleneck that fully async hides, so each fully-async update has requests in flight (with training longer
than generation a one-batch-deep pool has finished its next batch and sits idle at every update, and there is
nothing to keep or abort). The sync arm runs first. Arms:
  ours        train_async.py + `rollout.slime.generate_rollout_fully_async` (no staleness bound, as slime's;
              `--lag` sets one), an engine with the weight-update-pause fix (retract: in-flight requests kept);
  sync        train.py + slime's own `slime.rollout.sglang_rollout.generate_rollout`, the same engine;
  slime-async train_async.py + slime's own `slime.rollout.fully_async_rollout.generate_rollout_fully_async`, an
              engine with `rollout.weight_update_pause: abort` (SGLang's own abort-mode pause, as stock);
  off         as ours, on an engine with `retraction-routes` disabled (the k3 control);
  kill        as ours on two engines, max_weight_version_lag `--kill-lag`; one engine is killed with SIGKILL
              `--kill-delay-s` after the loop's first update.
Each engine serves a few batches before any arm is timed (the CPU engine's first batch shapes are slow).
slime's fully-async arm sends its requests to its one engine, not through slime's router (every PyPI sglang-router
drops `return_routed_experts`), and asks for routed experts as ours do (slime's own `Sample` code decodes them),
so both pay the same capture; the sync arm goes through the router (slime's sync rollout lists the router's
workers to abort its leftovers at every step) and asks for none.

    flock /tmp/engine.lock python benchmarks/fully_async_update.py --slime-src /tmp/slime-src
    python benchmarks/fully_async_update.py --dry      # the judging on recorded figures, no engine, no slime

Judged (benchmarks/targets.toml), per weight update with requests in flight (the loops' updates after their
first), ours / slime-async: `aborted_tokens` (tokens of in-flight requests the update's pause ended: their
answers came back `abort`), `thrown_tokens` (tokens the engines generated that no delivered sample holds:
every /generate answer counted, every group drained at the end; judged where slime's is above 0, else one line
says so). Trainer wait per step (the loop's time not spent in the stand-in's training or in slime's weight
update, from the end of the first step's training to the end of the last), ours / sync and ours /
slime-async. Replay k3 KL (benchmarks/_replay.py: each token under the weights of the version that sampled it,
the sample's one routed-experts array) on ours' samples that span an update / those that do not, and the same
on `off`, which must miss. The kill arm: groups delivered more than once or never (count, 0).
Without a slime checkout or SLIME_PYTHON it prints why and judges nothing (every arm runs slime's loop).
"""
import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _slime_arm import Worker, unavailable  # noqa: E402
from _targets import fact, finish, judge  # noqa: E402

BENCH = "fully_async_update"
CONFIG = os.path.join(ROOT, "training_configs", "near-tie-cpu.yaml")
OURS = "rollout.slime.generate_rollout_fully_async"
SLIME_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
SLIME_SYNC = "slime.rollout.sglang_rollout.generate_rollout"
ARMS = ("ours", "sync", "slime-async", "off", "kill")


# ------------------------------------------------------------------ figures and judging
def trainer_wait(res: dict, updates: bool = False) -> tuple:
    """(mean wait per step after the first, the first step's wait): loop time outside training and updates
    (`updates`: outside training only, the weight updates counted as waiting)."""
    train = sorted(res["train"], key=lambda t: t[1])
    start, end = train[0][2], train[-1][2]
    busy = sum(max(0.0, min(b, end) - max(a, start)) for _, a, b in train[1:])
    if not updates:
        busy += sum(max(0.0, min(b, end) - max(a, start)) for a, b in res["updates"])
    first = train[0][1] - res["updates"][0][1]
    return (end - start - busy) / max(1, len(train) - 1), first


def update_s(res: dict) -> float:
    """The median seconds of the loop's weight updates after the first (slime's pause, flush, load, continue)."""
    took = sorted(b - a for a, b in res["updates"][1:])
    return took[len(took) // 2]


def sync_generation(res: dict) -> float:
    """The median seconds of the sync arm's generate calls after the first."""
    took = sorted(b - a for a, b in (s["t"] for s in res["steps"][1:]))
    return took[len(took) // 2]


def per_update(res: dict) -> dict:
    """Tokens per loop update with work in flight (the updates after the first)."""
    n = max(1, len(res["updates"]) - 1)
    delivered = sum(s["tokens"] for s in res["steps"] + res["drained"])
    undelivered = res["handed"] - len(set(res["delivered"]))
    return {"updates": n, "aborted": res["tally"]["aborted_tokens"] / n,
            "aborted_answers": res["tally"]["aborted"] / n, "retracted": res["tally"].get("retracted", 0) / n,
            "thrown": (res["tally"]["tokens"] - delivered) / n, "undelivered": undelivered,
            "generated": res["tally"]["tokens"], "delivered": delivered}


def once(res: dict) -> int:
    """Groups delivered more than once, plus groups taken from the data source and never delivered."""
    d = res["delivered"]
    return (len(d) - len(set(d))) + (res["handed"] - len(set(d)))


def report(res: dict, k3: dict) -> None:
    if "train_s" in res:
        fact(BENCH, f"stand-in training per step {res['train_s']:.2f} s; sync's generation per step "
                    f"{sync_generation(res['sync']):.2f} s (median after the first)")
    tok = {arm: per_update(res[arm]) for arm in ("ours", "slime-async", "off")}
    for arm, t in tok.items():
        fact(BENCH, f"{arm}: per update ({t['updates']}): {t['retracted']:.1f} answers kept through it "
                    f"(retracted, resumed), {t['aborted_answers']:.1f} answers aborted holding "
                    f"{t['aborted']:.1f} tokens, {t['thrown']:.1f} tokens thrown away ({t['generated']} generated, "
                    f"{t['delivered']} delivered, {t['undelivered']} groups undelivered)")
    if tok["slime-async"]["aborted"] > 0:
        judge(BENCH, "aborted_tokens", tok["ours"]["aborted"] / tok["slime-async"]["aborted"])
    else:
        fact(BENCH, "aborted_tokens not judged: no request of slime's fully-async was in flight at its updates "
                    "(raise --groups or --max-new-tokens)")
    if tok["slime-async"]["thrown"] > 0:
        judge(BENCH, "thrown_tokens", tok["ours"]["thrown"] / tok["slime-async"]["thrown"])
    else:
        fact(BENCH, f"thrown_tokens not judged: slime's fully-async threw away {tok['slime-async']['thrown']:.1f} "
                    f"tokens per update (its worker puts each ABORTED group back in the buffer and slime's generate "
                    f"continues every sample from the tokens its aborted answer carried); ours "
                    f"{tok['ours']['thrown']:.1f}")
    waits = {arm: trainer_wait(res[arm]) for arm in ("ours", "sync", "slime-async")}
    fact(BENCH, "trainer wait per step after the first (first step; the weight update itself, median, not in the "
                "wait): " + ", ".join(f"{arm} {w:.2f} s ({f:.2f} s; {update_s(res[arm]):.2f} s)"
                                      for arm, (w, f) in waits.items()))
    idle = {arm: trainer_wait(res[arm], updates=True)[0] for arm in waits}
    fact(BENCH, "trainer time outside training per step (its wait and the weight update): " + ", ".join(
        f"{arm} {t:.2f} s" for arm, t in idle.items()) + f"; ours / slime-async {idle['ours'] / idle['slime-async']:.3f}"
        f", ours / sync {idle['ours'] / idle['sync']:.3f}")
    judge(BENCH, "trainer_wait_vs_sync", waits["ours"][0] / waits["sync"][0])
    judge(BENCH, "trainer_wait_vs_slime_async", waits["ours"][0] / waits["slime-async"][0]
          if waits["slime-async"][0] > 0 else float("inf"))
    for arm in ("ours", "off"):
        k = k3[arm]
        fact(BENCH, f"replay k3 KL, {arm}: spanning an update {k['span']:.3g} ({k['span_tokens']} tokens, "
                    f"{k['span_samples']} samples), not {k['rest']:.3g} ({k['rest_tokens']} tokens); tokens after "
                    f"the first update {k.get('after', float('nan')):.3g}")
    judge(BENCH, "k3_kl_spanning", k3["ours"]["span"] / k3["ours"]["rest"])
    judge(BENCH, "k3_kl_spanning_disabled", k3["off"]["span"] / k3["off"]["rest"])
    kill = res["kill"]
    fact(BENCH, f"kill: {len(kill['kills'])} engine killed, {len(kill['updates']) - 1} loop updates, "
                f"{len(kill['delivered'])} groups delivered of {kill['handed']} taken, calls returned "
                f"{[len(s['groups']) for s in kill['steps']]} groups")
    judge(BENCH, "groups_not_once", float(once(kill)) if kill["kills"] else float("inf"))
    for arm in ARMS:
        lags = [s["metrics"].get("rollout/stale_groups", 0) or 0 for s in res[arm]["steps"]]
        if any(lags):
            fact(BENCH, f"{arm}: stale groups regenerated per call {lags}")
        if res[arm].get("dry"):
            fact(BENCH, f"{arm}: the data source ran out of prompts {res[arm]['dry']} times before the loop ended "
                        f"(its later updates had less in flight: see prompt_count)")


# ------------------------------------------------------------------ the run
def perturbed(base: str, out: str, versions: int, std: float) -> None:
    """v1..v`versions`: the base checkpoint with N(0, std) added to every router weight, seeded by the version."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(base, "model.safetensors"))
    for v in range(1, versions + 1):
        d = os.path.join(out, f"v{v}")
        shutil.copytree(base, d, dirs_exist_ok=True)
        g = torch.Generator().manual_seed(v)
        new = {k: (t.float() + std * torch.randn(t.shape, generator=g)).to(t.dtype) if k.endswith("mlp.gate.weight")
               else t for k, t in tensors.items()}
        save_file(new, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


class SlimeLoop(Worker):
    """benchmarks/_slime_loop.py under SLIME_PYTHON: one arm per request line, its answer back."""

    def __init__(self, slime_src: str):
        super().__init__(slime_src, [os.path.join(HERE, "_slime_loop.py")], paths=(HERE,),
                         env={"SLIME_MOE_ROLLOUT_CONFIG": CONFIG})
        self.ready = self.ready["ready"]

    def arm(self, spec: dict) -> dict:
        t0 = time.monotonic()
        out = self.ask(spec)
        print(f"  {spec['arm']}: {time.monotonic() - t0:.0f} s, {len(out['steps'])} steps, "
              f"{len(out['updates'])} updates, tally {out['tally']}", flush=True)
        return out


def fleet_config(arms: dict):
    """near-tie-cpu.yaml with one engine group per name in `arms` (name -> extra engine env, engine count)."""
    from rollout import config as rconfig

    cfg = rconfig.load(CONFIG)
    cfg.rollout.budgets.http_s = cfg.rollout.budgets.server_up_s = 600.0
    cfg.rollout.health.interval_s = 30.0   # the benchmark's own manager only starts the engines
    base = cfg.engine_groups[0]
    cfg.engine_groups = [base.model_copy(update={"name": name, "engines": n, "env": {**base.env, **env}}, deep=True)
                         for name, (env, n) in arms.items()]
    return cfg


async def started(cfg, model, prefix):
    from rollout.engines.fleet import Restarts
    from rollout.engines.local_backend import LocalBackend
    from rollout.manager import RolloutManager
    from rollout.net import free_port

    ports = [free_port(cfg.rollout.host) for _ in range(sum(g.engines for g in cfg.engine_groups))]
    mgr = RolloutManager.from_config(cfg, LocalBackend(tempfile.mkdtemp(prefix=prefix)), model, ports=ports)
    mgr.source.restarts = Restarts(max_restarts=0)   # a killed engine stays dead
    await mgr.start()
    return mgr


async def warm(engines, max_new_tokens: int) -> None:
    """Each engine's first batch shapes (slow the first time on the CPU engine) before any arm is timed."""
    import aiohttp

    rng = random.Random(1)
    async with aiohttp.ClientSession() as s:
        async def one(url):
            body = {"input_ids": [rng.randrange(3, 300) for _ in range(8)], "return_logprob": True,
                    "return_routed_experts": True, "sampling_params": {"max_new_tokens": max_new_tokens}}
            async with s.post(url + "/generate", json=body) as r:
                r.raise_for_status()
                await r.read()
        for batch in (16, 8, 4, 2, 1):
            await asyncio.gather(*(one(e.url) for e in engines for _ in range(batch)))


def prompt_count(steps: int, groups: int, concurrency: int, engines: int = 2) -> int:
    """Prompts for one arm: its steps' groups plus the most a fully-async pool takes ahead of the trainer (slime's
    worker: `concurrency` x engines groups in flight and as many finished ones queued; ours fewer), so no pool runs
    dry before the loop's last update (a dry pool has nothing in flight to keep or abort there)."""
    return steps * groups + 2 * concurrency * engines + groups


def run(a, model: str, ckpts: str, work: str) -> dict:
    from sglang_patches.fixes.weight_update_pause import ENV as PAUSE_ENV
    from sglang_patches.registry import DISABLE_ENV

    rng = random.Random(0)
    n_prompts = prompt_count(a.steps, a.groups, a.concurrency)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 12))] for _ in range(n_prompts)]
    res: dict = {}

    def spec(arm, loop, fn, addrs, **kw):
        disk = os.path.join(work, f"disk-{arm}")
        os.makedirs(disk, exist_ok=True)
        base = {"arm": arm, "loop": loop, "fn": fn, "addrs": addrs, "config": CONFIG, "model": model,
                "ckpts": ckpts, "disk_dir": disk, "steps": a.steps, "groups": a.groups, "train_s": res["train_s"],
                "max_new_tokens": a.max_new_tokens, "concurrency": a.concurrency, "prompts": prompts,
                "r3": fn in (OURS, SLIME_ASYNC), "direct": fn == SLIME_ASYNC,
                "kill_delay_s": a.kill_delay_s, "kill_notice_s": a.kill_notice_s,
                "overrides": {"max_weight_version_lag": a.lag} if fn == OURS and a.lag is not None else {}}
        return {**base, **kw}

    async def phases():
        worker = await asyncio.to_thread(SlimeLoop, a.slime_src)
        print(f"  {worker.ready}", flush=True)
        try:
            mgr = await started(fleet_config({"fixed": ({}, 2)}), model, "bench-fau-a-")
            try:
                engines = list(mgr.source.engines.values())
                await warm(engines, a.max_new_tokens)
                addrs = [e.url.split("://", 1)[1] for e in engines]
                res["train_s"] = a.train_s if a.train_s is not None else 1.0   # sync's wait does not depend on it
                res["sync"] = await asyncio.to_thread(worker.arm, spec("sync", "train", SLIME_SYNC, addrs[:1]))
                if a.train_s is None:
                    res["train_s"] = a.train_frac * sync_generation(res["sync"])
                print(f"  stand-in training per step: {res['train_s']:.2f} s", flush=True)
                res["ours"] = await asyncio.to_thread(worker.arm, spec("ours", "train_async", OURS, addrs[:1],
                                                                       dump=os.path.join(work, "ours.jsonl")))
                res["kill"] = await asyncio.to_thread(worker.arm, spec(
                    "kill", "train_async", OURS, addrs, kill_after_update=1, kill_engine=1,
                    kill_pids=engines[1].tree_pids(), overrides={"max_weight_version_lag": a.kill_lag}))
            finally:
                await mgr.stop()
            mgr = await started(fleet_config({"abort": ({PAUSE_ENV: "abort"}, 1),
                                              "off": ({DISABLE_ENV: "retraction-routes"}, 1)}), model, "bench-fau-b-")
            try:
                await warm(list(mgr.source.engines.values()), a.max_new_tokens)
                by = {e.name: e.url.split("://", 1)[1] for e in mgr.source.engines.values()}
                abort = [u for name, u in by.items() if name.startswith("abort")]
                off = [u for name, u in by.items() if name.startswith("off")]
                res["slime-async"] = await asyncio.to_thread(worker.arm, spec("slime-async", "train_async",
                                                                              SLIME_ASYNC, abort))
                res["off"] = await asyncio.to_thread(worker.arm, spec("off", "train_async", OURS, off,
                                                                      dump=os.path.join(work, "off.jsonl")))
            finally:
                await mgr.stop()
        finally:
            worker.close()
    asyncio.run(phases())
    return res


def replay_k3(model: str, ckpts: str, dump: str) -> dict:
    """k3 KL of the replay on the dumped samples that span an update vs those that do not."""
    import numpy as np
    from _replay import Replayed, pooled, split_at_first_change

    from rollout.r3.replay import load_model

    models: dict = {}

    def lm_for(version):
        path = model if version in (None, "default") else os.path.join(ckpts, f"v{version}")
        if path not in models:
            models[path] = load_model(path, "bfloat16")
        return models[path]

    samples = []
    with open(dump) as f:
        for line in f:
            r = json.loads(line)
            if r["routed_experts"] is None or not r["response_ids"] or not r["spans"]:
                continue
            samples.append(Replayed(r["prompt_ids"], r["response_ids"], r["logprobs"],
                                    np.asarray(r["routed_experts"], np.int64), r["spans"]))
    span = [s for s in samples if s.spans_update]
    rest = [s for s in samples if not s.spans_update]
    if not span or not rest:
        raise RuntimeError(f"{dump}: need samples that span an update and samples that do not: "
                           f"{len(span)} / {len(rest)}")
    a, b = pooled(lm_for, span), pooled(lm_for, rest)
    split = split_at_first_change(lm_for, span)
    return {"span": a.k3_kl, "rest": b.k3_kl, "span_tokens": a.tokens, "rest_tokens": b.tokens,
            "span_samples": len(span), "after": split.get("after", {}).get("k3_kl", float("nan"))}


def _dry_arm(waits, aborted, thrown=0, kill=False) -> dict:
    """Recorded figures of one arm in the worker's answer shape (for --dry): `waits` before each step's training
    (2 s), a 0.5 s update after each; `aborted` / `thrown` tokens per loop update."""
    t, train, updates = 10.0, [], [[9.0, 10.0]]
    for i, w in enumerate(waits):
        train.append([i, t + w, t + w + 2.0])
        updates.append([t + w + 2.0, t + w + 2.5])
        t += w + 2.5
    n = len(waits)
    return {"train": train, "updates": updates, "drained": [], "handed": 2 * n, "delivered": list(range(2 * n)),
            "steps": [{"tokens": 380, "groups": [2 * i, 2 * i + 1], "metrics": {}} for i in range(n)],
            "kills": [20.0] if kill else [],
            "tally": {"tokens": n * 380 + n * thrown, "aborted_tokens": n * aborted, "aborted": 2 * n if aborted else 0,
                      "retracted": 0 if aborted else 2 * n}}


DRY = {"ours": _dry_arm([0.5, 0.1, 0.2, 0.1], 0), "sync": _dry_arm([3.0, 3.1, 2.9, 3.0], 0),
       "slime-async": _dry_arm([1.2, 0.9, 1.1, 1.0], 150, thrown=40), "off": _dry_arm([0.5, 0.1, 0.2, 0.1], 0),
       "kill": _dry_arm([0.5, 2.0, 0.2, 0.1], 0, kill=True)}
DRY_K3 = {"ours": {"span": 0.00041, "rest": 0.0004, "span_tokens": 900, "rest_tokens": 700, "span_samples": 20,
                   "after": 0.00042},
          "off": {"span": 0.0012, "rest": 0.0004, "span_tokens": 900, "rest_tokens": 700, "span_samples": 20,
                  "after": 0.002}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="training steps per arm (a weight update after each)")
    ap.add_argument("--groups", type=int, default=4, help="groups per step (rollout_batch_size), 2 samples each")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8, help="sglang_server_concurrency (per engine)")
    ap.add_argument("--train-s", type=float, default=None, help="the stand-in trainer's seconds per step (default: "
                    "--train-frac of the sync arm's generation per step)")
    ap.add_argument("--train-frac", type=float, default=0.8, help="training per step / the sync arm's generation")
    ap.add_argument("--lag", type=int, default=None, help="ours' max_weight_version_lag (default none, as slime's "
                    "fully-async has none)")
    ap.add_argument("--kill-lag", type=int, default=1, help="the kill arm's max_weight_version_lag")
    ap.add_argument("--perturb", type=float, default=0.02, help="std of the noise added to router weights")
    ap.add_argument("--kill-delay-s", type=float, default=1.0, help="kill arm: seconds after the first loop update")
    ap.add_argument("--kill-notice-s", type=float, default=2.0,
                    help="kill arm: seconds until slime's health monitor (stand-in) takes the engine out")
    ap.add_argument("--slime-src", default=os.environ.get("SLIME_SRC") or None,
                    help="a slime checkout (default: $SLIME_SRC); every arm runs slime's loops")
    ap.add_argument("--dry", action="store_true", help="judge recorded figures (no engine, no slime)")
    a = ap.parse_args(argv)
    if min(a.steps, a.groups, a.max_new_tokens, a.concurrency) < 2 or (a.train_s or 0) < 0 or (a.lag or 0) < 0 \
            or not 0 < a.train_frac <= 1 \
            or a.kill_lag < 0 or a.perturb < 0:
        ap.error("--steps, --groups, --max-new-tokens, --concurrency must be >= 2; --train-frac in (0, 1]; "
                 "--train-s, --lag, --kill-lag, --perturb >= 0")
    if a.dry:
        fact(BENCH, "dry run: recorded figures, no engine")
        report(DRY, DRY_K3)
        return finish()
    why = unavailable(a.slime_src)
    if why:
        fact(BENCH, f"not run: {why} (every arm runs slime's own training loop)")
        return 0
    from rollout.models.near_tie import build_near_tie_glm

    model = build_near_tie_glm()
    work = tempfile.mkdtemp(prefix="bench-fully-async-")
    ckpts = os.path.join(work, "ckpts")
    perturbed(model, ckpts, a.steps + 2, a.perturb)
    print(f"{BENCH}: near-tie CPU engines, {a.steps} steps x {a.groups} groups x 2 samples x {a.max_new_tokens} "
          f"tokens, stand-in training per step " + (f"{a.train_s:g} s" if a.train_s is not None else
                                                     f"{a.train_frac:g} x sync's generation") +
          f", router weights + N(0, {a.perturb:g}) per version; "
          f"work in {work}", flush=True)
    res = run(a, model, ckpts, work)
    with open(os.path.join(work, "figures.json"), "w") as f:   # kept should the replay fail
        json.dump({"res": res}, f)
    k3 = {arm: replay_k3(model, ckpts, os.path.join(work, f"{arm}.jsonl")) for arm in ("ours", "off")}
    with open(os.path.join(work, "figures.json"), "w") as f:
        json.dump({"res": res, "k3": k3}, f)
    report(res, k3)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
