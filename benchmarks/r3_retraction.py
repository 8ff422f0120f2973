"""Retract-mode weight update mid-rollout: samples kept, and their replay mismatch, with the retraction-rows fix.

A real SGLang CPU engine (training_configs/near-tie-cpu.yaml: the near-tie tiny GLM-4.5, the plugin on) rolls
prompts out through the rollout manager (routed experts, logprobs, every answer's meta_info kept). Once a third
of the groups are in, the update runs as Miles runs it: `pause_generation(mode="retract")`, flush, a weight
update, `update_weight_version`, `continue_generation`. The update reloads the same checkpoint under a new
version name, so every token's sampling weights equal the trainer's and the replay mismatch isolates the rows.

Judged (benchmarks/targets.toml):
- refused_with_fix: samples the manager refused (the engine states its retraction rule in meta_info); target 0.
  Printed beside it: the samples today's client refuses on the same answers (`retraction_reason` without the
  engine's statement), and the mean response length of those vs the rest (the length bias of dropping them).
- k3_kl_retracted: k3 KL of `r3 check`'s replay (transformers' forward with the captured rows) on the
  retracted samples / on the unretracted ones; target <= 1.5.
"""
import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _targets import fact, finish, judge  # noqa: E402

CONFIG = os.path.join(ROOT, "training_configs", "near-tie-cpu.yaml")
BENCH = "r3_retraction"


async def _update_when(mgr, sink, after_groups: int, model: str) -> str:
    """Miles' update sequence on every engine once `after_groups` groups are in; returns the new version."""
    import aiohttp

    from rollout.net import auth_headers

    while len(sink.groups) < after_groups:
        await asyncio.sleep(0.05)
    for eng in list(mgr.source.engines.values()):
        h = auth_headers(eng.api_key)
        async with aiohttp.ClientSession() as s:
            for method, path, body in (("post", "/pause_generation", {"mode": "retract"}),
                                       ("get", "/flush_cache", None),
                                       ("post", "/update_weights_from_disk", {"model_path": model}),
                                       ("post", "/update_weight_version", {"new_version": "v2",
                                                                          "abort_all_requests": False}),
                                       ("post", "/continue_generation", {})):
                async with s.request(method, eng.url + path, json=body, headers=h) as r:
                    if r.status != 200 and path != "/flush_cache":
                        raise RuntimeError(f"{path}: HTTP {r.status} {(await r.text())[:200]}")
    return "v2"


async def _rollout(mgr, prompts, model, after_groups):
    from rollout.r3.check import _Sink

    sink = _Sink()
    await mgr.start()
    try:
        update = asyncio.create_task(_update_when(mgr, sink, after_groups, model))
        await mgr.rollout(prompts, sink, batch_size=len(prompts))
        await update
    finally:
        await mgr.stop()
    return [s for g in sink.groups for s in g.samples]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args()
    import numpy as np

    from rollout import config as rconfig
    from rollout.cli.run import prompts_for
    from rollout.engines.local_backend import LocalBackend
    from rollout.manager import RolloutManager, RolloutOptions, engine_source
    from rollout.models.near_tie import build_near_tie_glm
    from rollout.net import free_port
    from rollout.r3.check import RolloutSample, arm
    from rollout.r3.replay import load_model
    from rollout.routed_experts.retraction import retraction_reason
    from rollout.types import SampleStatus
    from sglang_patches.fixes.retraction_rows import META_KEY

    model = build_near_tie_glm()
    cfg = rconfig.load(a.config)
    cfg.rollout.budgets.http_s = cfg.rollout.budgets.server_up_s = 600.0
    cfg.rollout.sampling.max_new_tokens = a.max_new_tokens
    source = engine_source(cfg, LocalBackend(tempfile.mkdtemp(prefix="bench-retraction-")), model,
                           ports=[free_port(cfg.rollout.host)])
    mgr = RolloutManager(source, dataclasses.replace(RolloutOptions.from_config(cfg), keep_answers=True))
    prompts = prompts_for(cfg.model.vocab_size or 320, a.prompts, 0)
    samples = asyncio.run(_rollout(mgr, prompts, model, max(1, a.prompts // 3)))

    def meta(s):
        return s.outputs[-1][2] if s.outputs else {}

    refused = [s for s in samples if s.status is SampleStatus.FAILED]
    retracted = [s for s in samples if int(meta(s).get("num_retractions") or 0)]
    today = [s for s in samples if retraction_reason({k: v for k, v in meta(s).items() if k != META_KEY},
                                                     s.sent_version)]
    rest = [s for s in samples if s not in today]
    fact(BENCH, f"{len(samples)} samples, {len(retracted)} retracted, {len(today)} spanning the update; "
                f"statuses {sorted({s.status.value for s in samples})}")
    for s in refused:
        print(f"  refused: {s.sample_id}: {s.error}")
    length = lambda ss: float(np.mean([len(s.response_ids) for s in ss])) if ss else float("nan")  # noqa: E731
    fact(BENCH, f"refused without the fix (today's client on the same answers): {len(today)}; mean response "
                f"length {length(today):.1f} tokens vs {length(rest):.1f} for the rest")
    judge(BENCH, "refused_with_fix", float(len(refused)))
    kept = [s for s in samples if s.status.finished and s.routed_experts is not None]
    as_rs = lambda ss: [RolloutSample(s.prompt_ids, s.response_ids, s.logprobs, s.routed_experts)  # noqa: E731
                        for s in ss]
    ret = [s for s in kept if s in retracted]
    unret = [s for s in kept if s not in retracted]
    if not ret or not unret:
        raise RuntimeError(f"need retracted and unretracted samples: {len(ret)} / {len(unret)}")
    lm = load_model(model, "bfloat16")
    replay_r = arm(lm, as_rs(ret), [s.routed_experts for s in ret])
    replay_u = arm(lm, as_rs(unret), [s.routed_experts for s in unret])
    fact(BENCH, f"replay k3 KL retracted {replay_r.k3_kl:.3g} ({replay_r.tokens} tokens, flip rate "
                f"{replay_r.flip_rate:.2%}), unretracted {replay_u.k3_kl:.3g} ({replay_u.tokens} tokens, "
                f"flip rate {replay_u.flip_rate:.2%}); mean |d| {replay_r.mean_abs_diff:.3g} vs "
                f"{replay_u.mean_abs_diff:.3g}")
    judge(BENCH, "k3_kl_retracted", replay_r.k3_kl / replay_u.k3_kl if replay_u.k3_kl > 0 else float("inf"))
    return finish()


if __name__ == "__main__":
    sys.exit(main())
