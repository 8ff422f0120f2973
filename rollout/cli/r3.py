"""`slime-moe-rollout r3 check`: rollout-vs-trainer logprob mismatch with and without routing replay.

Prompts go through the rollout manager to real SGLang engines (a training config's engines, started
and stopped here, or a running engine at --url) with logprobs and routed experts on; the trainer
side recomputes the same response tokens with transformers' GLM-4.5 forward in the same dtype,
(a) with its own routing and (b) with the captured routing replayed. One table (or --json).
Exit 0 when replay reduces both k3 KL and mean |d|; 1 when it does not; 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from rollout.cli import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("r3", help="routing replay (R3): what it buys", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r3 = p.add_subparsers(dest="r3_command", required=True)
    c = r3.add_parser("check", help="logprob mismatch with and without routing replay, on real engines",
                      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="training config YAML: its engines are started (and stopped) here")
    src.add_argument("--url", help="a running SGLang engine (started with --enable-return-routed-experts)")
    src.add_argument("--samples", help="recorded rollout samples (JSON written by --save-samples)")
    c.add_argument("--api-key-env", metavar="VAR", default=None,
                   help="with --url: the environment variable holding the engine's API key (never on argv)")
    c.add_argument("--model", help="checkpoint for the trainer recompute and the engines (default: the config's "
                   "model path; a config's model.build writes it there)")
    c.add_argument("--prompts", type=positive_int, default=None, help="prompts to roll out (default: rollout.batch_size)")
    c.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    c.add_argument("--max-new-tokens", type=positive_int, default=None, help="override the sampling budget")
    c.add_argument("--dtype", default=None, help="trainer dtype (default: the checkpoint's torch_dtype)")
    c.add_argument("--corrupt", choices=("shift", "swap"), default=None,
                   help="replay wrong rows on purpose (shift: one token down; swap: another sample's)")
    c.add_argument("--save-samples", default=None, help="also write the rollout samples to this JSON file")
    c.add_argument("--log-dir", default=None, help="engine logs (default: ./r3-check.logs)")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=main)


def main(args) -> int:
    from rollout.cli.run import prompts_for
    from rollout.errors import CliError, short_error
    from rollout.r3 import check

    cfg = None
    if args.config:
        from rollout import config as rconfig
        cfg = rconfig.load(args.config)
    model_path = args.model
    if cfg:
        from rollout import models
        cfg.model.path = args.model or cfg.model.path
        model_path = cfg.model_path(build=models.build)  # model.build writes it there
    if model_path is None:
        raise CliError("r3 check: --model is required with --url or --samples")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise CliError(f"r3 check: {model_path} is not a checkpoint directory (no config.json)")
    model_path = os.path.abspath(model_path)
    with open(os.path.join(model_path, "config.json")) as f:
        hf_cfg = json.load(f)
    dtype = args.dtype or hf_cfg.get("torch_dtype") or "bfloat16"
    try:
        samples, notes = _samples(args, cfg, model_path, hf_cfg, prompts_for)
        rep = check.run(samples, model_path, dtype, args.corrupt, notes)
    except (ValueError, OSError) as e:
        raise CliError(f"r3 check: {short_error(e)}") from None
    if args.save_samples:
        _save(args.save_samples, samples, model_path, cfg, args)
    print(json.dumps(rep.as_dict(), indent=2) if args.json else check.table(rep))
    return 0 if rep.replay_reduces else 1


def _save(path: str, samples: list, model_path: str, cfg, args) -> None:
    """The rollout samples with where they came from (engine version, config, model build stamp)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        sglang = version("sglang")
    except PackageNotFoundError:
        sglang = None
    stamp_path = os.path.join(model_path, "tiny_glm_build.json")
    build = json.load(open(stamp_path)) if os.path.isfile(stamp_path) else None
    meta = {"sglang": sglang, "config": cfg.name if cfg else None, "url": args.url, "seed": args.seed,
            "model": os.path.basename(model_path), "build": build}
    with open(path, "w") as f:
        json.dump({"meta": meta, "samples": [s.as_dict() for s in samples]}, f, separators=(",", ":"))
        f.write("\n")


def _samples(args, cfg, model_path, hf_cfg, prompts_for) -> tuple:
    from rollout.r3 import check

    if args.samples:
        with open(args.samples) as f:
            return [check.RolloutSample.from_dict(d) for d in json.load(f)["samples"]], []
    n = args.prompts or (cfg.rollout.batch_size if cfg else 8)
    prompts = prompts_for(int(hf_cfg["vocab_size"]), n, args.seed)
    if cfg is not None:
        from rollout.engines.local_backend import LocalBackend
        if args.max_new_tokens:
            cfg.rollout.sampling.max_new_tokens = args.max_new_tokens
        log_dir = os.path.abspath(args.log_dir or "r3-check.logs")
        print(f"r3 check: starting {sum(g.engines for g in cfg.engine_groups)} engine(s) of {cfg.name}, "
              f"logs in {log_dir}", file=sys.stderr, flush=True)
        return check.rollout_from_config(cfg, model_path, prompts, LocalBackend(log_dir))
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": args.max_new_tokens or 16}
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if key is None:
            raise ValueError(f"--api-key-env: ${args.api_key_env} is not set")
    return check.rollout_from_url(args.url, model_path, prompts, sampling, n_samples=2, api_key=key)
