"""Retract-mode weight update mid-rollout: samples kept, and their replay mismatch, with the retraction fixes.

A real SGLang CPU engine (training_configs/near-tie-cpu.yaml: the near-tie tiny GLM-4.5, the plugin on) rolls
prompts out through the rollout manager (routed experts, logprobs, every answer's meta_info kept). Each time a
quarter of the groups are in (`--updates 3`), an update runs as Miles runs it: `pause_generation(mode="retract")`,
flush, a weight update under a new version name, `continue_generation`. The update reloads the same checkpoint,
so every token's sampling weights equal the trainer's and the replay mismatch isolates the rows. Printed beside
the judged lines: the requests each update retracts, and the retracted samples' mismatch split at their first
update (the tokens sampled before the retraction and after the re-prefill).

Judged (benchmarks/targets.toml):
- refused_with_fix: samples the manager refused (the engine earns its retraction stamp: the scheduler's word that
  it kept the rows rides in meta_info beside it); target 0.
- refused_without_stamp: the control, the samples the client refuses on the same answers with the stamp but
  without the scheduler's evidence (what an engine that stamps every answer sends); it must refuse (>= 1), else
  the rollout spanned no update and refused_with_fix proves nothing. Printed beside it: the same count with no
  stamp at all (an engine without the fix), and the mean response length of those vs the rest (the length bias
  of dropping them).
- k3_kl_retracted: k3 KL of `r3 check`'s replay (transformers' forward with the captured rows) on the
  retracted samples / on the unretracted ones, target <= 1.1; and k3_kl_retracted_disabled, the same ratio from
  a second engine with `retraction-routes` disabled (its re-prefill routes as SGLang chooses), same prompts and
  updates, which must miss that target (>= 1.1), judged where that arm's re-prefill changed at least MIN_FLIPS of
  the kept token-layer rows (below that, one line says k3 cannot separate the arms: the DP-attention config's
  disabled re-prefill changed 0.29%).
- reprefill_agreement: of the retracted samples' kept token-layer rows, the share the re-prefill routed to the
  same expert set as sampled (the scheduler's own count, `reprefill_differ` / `reprefill_compared` in its
  evidence, taken before the splice); with retraction-routes the re-prefill is forced, target 1.0. And
  reprefill_agreement_disabled, the same share on the disabled arm, which must be below 1 (the re-prefill
  chose other experts somewhere). Where the disabled arm's re-prefill routed every kept row as sampled, the
  fix has nothing to change on that engine: the two disabled-arm targets are not judged and one line says so
  (no k3 ratio can separate arms whose re-prefills routed the same).
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
from _replay import Replayed, pooled, ratio, split_at_first_change, spans_from_meta  # noqa: E402
from _targets import fact, finish, judge  # noqa: E402

CONFIG = os.path.join(ROOT, "training_configs", "near-tie-cpu.yaml")
BENCH = "r3_retraction"
MIN_FLIPS = 0.01   # k3's control needs the disabled re-prefill to change at least this share of kept rows


async def _updates(mgr, sink, marks: list, model: str) -> None:
    """Miles' update sequence on every engine each time the groups in reach a mark (the same checkpoint, a new
    version each time): pause (retract), flush, update, continue."""
    from rollout.errors import EngineRejected

    for i, mark in enumerate(marks):
        while len(sink.groups) < mark:
            await asyncio.sleep(0.05)
        for eng in list(mgr.source.engines.values()):
            loads = await mgr.client.loads(eng)
            fact(BENCH, f"update {i + 1} after {mark} groups: {eng.name} runs "
                        f"{sum(ld.get('num_running_reqs') or 0 for ld in loads)} requests, "
                        f"{sum(ld.get('num_waiting_reqs') or 0 for ld in loads)} waiting")
            await mgr.client.pause_generation(eng, mode="retract")
            try:
                await mgr.client.flush_cache(eng)
            except EngineRejected:   # a flush the engine refuses while it holds requests changes nothing here
                pass
            await mgr.client.update_weights_from_disk(eng, model, f"v{i + 2}")
            await mgr.client.continue_generation(eng)


async def _rollout(mgr, prompts, model, marks):
    from rollout.r3.check import _Sink

    sink = _Sink()
    await mgr.start()
    try:
        update = asyncio.create_task(_updates(mgr, sink, marks, model))
        await mgr.rollout(prompts, sink, batch_size=len(prompts))
        await update
    finally:
        await mgr.stop()
    return [s for g in sink.groups for s in g.samples]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--updates", type=int, default=3, help="retract-mode updates, spread over the rollout")
    a = ap.parse_args()
    import numpy as np

    from rollout import config as rconfig
    from rollout.cli.run import prompts_for
    from rollout.engines.local_backend import LocalBackend
    from rollout.manager import RolloutManager, RolloutOptions, engine_source
    from rollout.models.near_tie import build_near_tie_glm
    from rollout.net import free_port
    from rollout.r3.replay import load_model
    from rollout.routed_experts.retraction import retraction_reason
    from rollout.types import SampleStatus
    from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, META_KEY
    from sglang_patches.registry import DISABLE_ENV

    model = build_near_tie_glm()
    lm = load_model(model, "bfloat16")
    one = lambda version: lm  # noqa: E731 - every update reloads the same checkpoint

    def meta(s):
        return s.outputs[-1][2] if s.outputs else {}

    def rollout(disable: str = ""):
        cfg = rconfig.load(a.config)
        cfg.rollout.budgets.http_s = cfg.rollout.budgets.server_up_s = 600.0
        cfg.rollout.sampling.max_new_tokens = a.max_new_tokens
        if disable:
            for g in cfg.engine_groups:
                g.env = {**g.env, DISABLE_ENV: disable}
        source = engine_source(cfg, LocalBackend(tempfile.mkdtemp(prefix="bench-retraction-")), model,
                               ports=[free_port(cfg.rollout.host)])
        mgr = RolloutManager(source, dataclasses.replace(RolloutOptions.from_config(cfg), keep_answers=True))
        prompts = prompts_for(cfg.model.vocab_size or 320, a.prompts, 0)
        marks = [max(1, a.prompts * (i + 1) // (a.updates + 1)) for i in range(a.updates)]
        return asyncio.run(_rollout(mgr, prompts, model, marks))

    def as_replayed(ss):
        return [Replayed(s.prompt_ids, s.response_ids, s.logprobs, s.routed_experts,
                         spans_from_meta(meta(s), len(s.response_ids))) for s in ss]

    def replay(samples):
        """(replay on the retracted kept samples, on the unretracted ones, the retracted ones)."""
        kept = [s for s in samples if s.status.finished and s.routed_experts is not None]
        ret = [s for s in kept if int(meta(s).get("num_retractions") or 0)]
        unret = [s for s in kept if s not in ret]
        if not ret or not unret:
            raise RuntimeError(f"need retracted and unretracted samples: {len(ret)} / {len(unret)}")
        return pooled(one, as_replayed(ret)), pooled(one, as_replayed(unret)), ret

    def agreement(ss):
        """(token-layer rows the re-prefill routed to another expert set than the kept rows, rows compared), over the
        retracted samples, from each answer's scheduler evidence."""
        differ = compared = 0
        for s in ss:
            word = meta(s).get(EVIDENCE_KEY)
            if isinstance(word, dict) and int(meta(s).get("num_retractions") or 0):
                differ += int(word.get("reprefill_differ") or 0)
                compared += int(word.get("reprefill_compared") or 0)
        return differ, compared

    samples = rollout()
    refused = [s for s in samples if s.status is SampleStatus.FAILED]
    retracted = [s for s in samples if int(meta(s).get("num_retractions") or 0)]
    def refused_without(*keys):
        return [s for s in samples if retraction_reason({k: v for k, v in meta(s).items() if k not in keys},
                                                        s.sent_version)]
    unearned, today = refused_without(EVIDENCE_KEY), refused_without(EVIDENCE_KEY, META_KEY)
    rest = [s for s in samples if s not in today]
    fact(BENCH, f"{len(samples)} samples, {len(retracted)} retracted, {len(today)} spanning the update; "
                f"statuses {sorted({s.status.value for s in samples})}")
    for s in refused:
        print(f"  refused: {s.sample_id}: {s.error}")
    length = lambda ss: float(np.mean([len(s.response_ids) for s in ss])) if ss else float("nan")  # noqa: E731
    fact(BENCH, f"refused with the stamp but without the scheduler's evidence: {len(unearned)}; without any stamp "
                f"(an engine without the fix): {len(today)}; mean response length {length(today):.1f} tokens vs "
                f"{length(rest):.1f} for the rest")
    judge(BENCH, "refused_with_fix", float(len(refused)))
    judge(BENCH, "refused_without_stamp", float(len(unearned)))
    replay_r, replay_u, ret = replay(samples)
    fact(BENCH, f"replay k3 KL retracted {replay_r.k3_kl:.3g} ({replay_r.tokens} tokens, flip rate "
                f"{replay_r.flip_rate:.2%}), unretracted {replay_u.k3_kl:.3g} ({replay_u.tokens} tokens, "
                f"flip rate {replay_u.flip_rate:.2%}); mean |d| {replay_r.mean_abs_diff:.3g} vs "
                f"{replay_u.mean_abs_diff:.3g}")
    for part, st in split_at_first_change(one, as_replayed(ret)).items():
        fact(BENCH, f"retracted samples, response tokens {part} their first update: k3 KL {st['k3_kl']:.3g}, "
                    f"mean |d| {st['mean_abs_diff']:.3g} ({st['tokens']} tokens)")
    off_samples = rollout(disable="retraction-routes")
    off_r, off_u, off_ret = replay(off_samples)
    split = ", ".join(f"{part} the update {st['k3_kl']:.3g}"
                      for part, st in split_at_first_change(one, as_replayed(off_ret)).items())
    fact(BENCH, f"without retraction-routes (the re-prefill routes as SGLang chooses): k3 KL retracted / "
                f"unretracted {off_r.k3_kl / off_u.k3_kl:.3f} ({len(off_ret)} retracted samples; {split})")
    fact(BENCH, f"k3 KL retracted / unretracted, side by side: fixed {ratio(replay_r, replay_u):.3f}, "
                f"retraction-routes disabled {ratio(off_r, off_u):.3f}")
    judge(BENCH, "k3_kl_retracted", ratio(replay_r, replay_u))
    (d_fix, n_fix), (d_off, n_off) = agreement(samples), agreement(off_samples)
    share = lambda d, n: 1.0 - d / n if n else float("nan")  # noqa: E731
    fact(BENCH, f"re-prefill routes vs the sampling-time rows (kept token-layer rows): fixed {d_fix} of {n_fix} "
                f"differ, retraction-routes disabled {d_off} of {n_off} differ")
    judge(BENCH, "reprefill_agreement", share(d_fix, n_fix))
    if n_off and d_off == 0:
        fact(BENCH, f"k3_kl_retracted_disabled and reprefill_agreement_disabled not judged: with retraction-routes "
                    f"disabled the re-prefill routed all {n_off} kept token-layer rows to the experts they were "
                    f"sampled with, so the fix has nothing to change on this engine and no k3 ratio can separate "
                    f"the arms")
        return finish()
    judge(BENCH, "reprefill_agreement_disabled", share(d_off, n_off))
    if d_off < MIN_FLIPS * n_off:
        fact(BENCH, f"k3_kl_retracted_disabled not judged: the disabled re-prefill changed {d_off} of {n_off} kept "
                    f"token-layer rows ({d_off / n_off:.2%}, under {MIN_FLIPS:.0%}): the tokens after the retraction "
                    f"attend to a nearly unchanged prefix, so k3 cannot separate the arms here (agreement does)")
    else:
        judge(BENCH, "k3_kl_retracted_disabled", ratio(off_r, off_u))
    return finish()


if __name__ == "__main__":
    sys.exit(main())
