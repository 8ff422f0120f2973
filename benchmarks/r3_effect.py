"""What routing replay buys: rollout-vs-trainer logprob mismatch without / with R3, on the near-tie model.

A real SGLang CPU engine (training_configs/near-tie-cpu.yaml: the near-tie tiny GLM-4.5, 64 experts,
top-8, 4 groups keep 2, 4 MoE layers, bf16) rolls prompts out through the manager with logprobs and
routed experts; transformers recomputes the same response tokens in bf16 with its own routing (a) and
with the captured routing replayed (b). The pair compared is always rollout logprob vs trainer
recompute, d = trainer - rollout. Judged (benchmarks/targets.toml): k3 KL (a)/(b), mean |d| (a)/(b),
and the flip rate of (a), which must show a near-tie model (>= 1% of token-layers) for the
reductions to mean anything. `--samples FILE` judges recorded engine output instead (no engine).
"""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _targets import MISS_EXIT, fact, finish, judge, target  # noqa: E402

CONFIG = os.path.join(ROOT, "training_configs", "near-tie-cpu.yaml")
AREAL = {"k3_kl": (0.00958, 0.000373), "mean_abs_diff": (0.0322, 0.00607),
         "extreme_frac_ln2": (0.00908, 6.8e-5), "extreme_frac_ln5": (0.00133, 4e-6)}


def samples_from_engine(config: str, prompts: int, model: str) -> list:
    from rollout import config as rconfig
    from rollout.cli.run import prompts_for
    from rollout.engines.local_backend import LocalBackend
    from rollout.r3.check import rollout_from_config

    cfg = rconfig.load(config)
    cfg.rollout.budgets.http_s = cfg.rollout.budgets.server_up_s = 600.0
    out, notes = rollout_from_config(cfg, model, prompts_for(cfg.model.vocab_size or 320, prompts, 0),
                                     LocalBackend(tempfile.mkdtemp(prefix="bench-r3-")))
    for n in notes:
        print(f"  note: {n}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG, help="training config of the engine (near-tie model)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--samples", default=None, help="recorded samples (r3 check --save-samples): no engine")
    ap.add_argument("--max-samples", type=int, default=None, help="use only the first N samples")
    ap.add_argument("--model", default=None, help="trainer checkpoint (default: the near-tie model, built here)")
    a = ap.parse_args()
    from rollout.models.near_tie import build_near_tie_glm
    from rollout.r3.check import RolloutSample, table
    from rollout.r3.check import run as r3_run

    model = a.model or build_near_tie_glm()
    if a.samples:
        with open(a.samples) as f:
            samples = [RolloutSample.from_dict(d) for d in json.load(f)["samples"]]
        fact("r3_effect", f"recorded engine output {os.path.relpath(a.samples, ROOT)}")
    else:
        samples = samples_from_engine(a.config, a.prompts, model)
    rep = r3_run(samples[: a.max_samples], model, "bfloat16")
    print(table(rep))
    print("  AReaL's published R3 table (Moonlight-16B-A3B, SGLang + Megatron), off -> on:")
    for k, (off, on) in AREAL.items():
        print(f"    {k:18s} {off:.3g} -> {on:.3g} ({off / on:.1f}x); here {getattr(rep.own, k):.3g} -> "
              f"{getattr(rep.replay, k):.3g}")
    near_tie = judge("r3_effect", "near_tie_flip_rate", rep.own.flip_rate)
    r = rep.ratios()
    judge("r3_effect", "k3_kl", r["k3_kl"])
    judge("r3_effect", "mean_abs_diff", r["mean_abs_diff"])
    if not near_tie:
        print(f"r3_effect: model not near-tie: routing flip rate without replay {rep.own.flip_rate:.2%} < "
              f"{target('r3_effect', 'near_tie_flip_rate')[1]:.0%} of token-layers; the reductions say nothing")
        return MISS_EXIT
    return finish()


if __name__ == "__main__":
    sys.exit(main())
