"""`slime-moe-rollout engine ...`: build the tiny model, launch one real SGLang engine and report on it,
print a config's per-node commands.

`engine launch --config a|b|c|CONFIG.yaml` starts the first engine of a config (the presets are
`rollout.config.PRESETS`) through the same backend and phased readiness as `run` and `serve`.
"""
from __future__ import annotations

import os
import re
import time
from typing import Optional

from sglang_patches.plugin import parse_active_fixes

_TIMINGS = re.compile(
    r"Engine startup timings \(s\): load_weight=([\d.]+), kv_cache_allocation=([\d.]+), "
    r"scheduler_e2e=([\d.]+), cuda_graph=\{([^}]*)\}, tokenizer_e2e=([\d.]+)"
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_parser(sub) -> None:
    from rollout.cli import port
    from rollout.config import PRESETS
    from rollout.models.tiny import VARIANTS

    p = sub.add_parser("engine", help="real SGLang on CPU: tiny model, launch, start-up report")
    esub = p.add_subparsers(dest="engine_command", required=True, parser_class=type(p))

    b = esub.add_parser("build-model", help="write the tiny GLM-4.5 MoE checkpoint (idempotent)")
    b.add_argument("--variant", choices=VARIANTS, default="random")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--path", default=None, help="output folder (default: <repo>/.cache/tiny-glm45[-match])")
    b.set_defaults(func=_build)

    la = esub.add_parser("launch", help="start a config's first engine, print its start-up phases and memory, stop it")
    la.add_argument("--config", required=True,
                    help="a training config YAML, or a preset: " + "; ".join(f"{k}: {v[1]}" for k, v in PRESETS.items()))
    la.add_argument("--model-path", default=None, help="checkpoint folder (default: the config's model, built if needed)")
    la.add_argument("--variant", choices=VARIANTS, default=None,
                    help="tiny-model variant (default: always-match with speculative decoding, else random)")
    la.add_argument("--log-dir", default=None, help="server log folder (default: .cache/logs)")
    la.add_argument("--port", type=port, default=None, help="HTTP port (default: a free one)")
    la.add_argument("--prompt", default="the quick brown fox", help="one greedy request after start-up ('' to skip)")
    la.add_argument("--max-new-tokens", type=int, default=8)
    la.add_argument("--no-plugin", action="store_true", help="run stock SGLang (SGLANG_PLUGINS=none)")
    la.add_argument("--disable", default="", help="comma-separated fix names to disable")
    la.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    la.set_defaults(func=_launch)

    pl = esub.add_parser("plan", help="print every engine's per-node SGLang command for a config; starts nothing")
    pl.add_argument("--config", required=True, help="training config YAML")
    pl.add_argument("--hosts", default=None,
                    help="comma-separated address of every cluster node (default: node-<i> on cuda, "
                         "rollout.host on cpu)")
    pl.add_argument("--model-path", default=None, help="checkpoint path to put in the commands (default: model.path)")
    pl.set_defaults(func=_plan)


def model_for(cfg, root: str = ".", variant: Optional[str] = None) -> str:
    """The config's model path, the tiny model built first when `model.build` asks for it. `variant`
    picks a tiny-model variant other than the config's (random) one, in its own default folder."""
    from rollout import models
    from rollout.models.tiny import build_tiny_glm, default_path

    if variant not in (None, "random") and cfg.model.build == "tiny-glm45":
        return build_tiny_glm(default_path(variant), variant=variant, seed=cfg.model.seed)
    return cfg.model_path(root, build=models.build)


def _build(args) -> int:
    from rollout.models.tiny import build_tiny_glm

    print(build_tiny_glm(args.path, variant=args.variant, seed=args.seed))
    return 0


def _plan(args) -> int:
    from rollout import config as rconfig
    from rollout.cli import CliError
    from rollout.engines.command import plan

    try:
        cfg = rconfig.load(args.config)
        hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts else None
        engines = plan(cfg, args.model_path, hosts)
    except ValueError as e:  # a ConfigError, or --hosts not matching the cluster
        raise CliError(str(e)) from None
    nodes = sum(len(e) for e in engines)
    print(f"# {cfg.name}: {len(engines)} engine(s), {nodes} node command(s), device {cfg.cluster.device}; "
          f"node 0 of each engine serves HTTP; the API key goes in a 0600 file passed with --config")
    for cmds in engines:
        for c in cmds:
            print(f"# engine {c.engine} node {c.node_rank}/{c.nnodes} on {c.host}")
            print(c.shell())
    return 0


def _launch(args) -> int:
    from rollout import config as rconfig
    from rollout.cli import CliError
    from rollout.cli.console import progress_bar, start_failure, stderr_console
    from rollout.engines.base import EngineStartError
    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.process import alive_pids
    from rollout.engines.readiness import ReadinessError, RichView, start_ready
    from rollout.net import free_port

    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be positive")
    cfg = rconfig.load(args.config)
    group = cfg.engine_groups[0]
    if args.model_path is not None:
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            raise CliError(f"--model-path {args.model_path}: no config.json there")
        model = os.path.abspath(args.model_path)
    else:
        variant = args.variant or ("always-match" if group.speculative else "random")
        try:
            model = model_for(cfg, ROOT, variant)
        except rconfig.ConfigError as e:
            raise CliError(str(e)) from None
    if args.no_plugin:
        group.env["SGLANG_PLUGINS"] = "none"
    if args.disable:
        group.env["SLIME_MOE_ROLLOUT_DISABLE"] = args.disable
    try:
        port = args.port or free_port(cfg.rollout.host)
    except OSError as e:
        raise CliError(f"engine launch: {e}") from None
    spec = first_engine_spec(cfg, model, port)
    backend = LocalBackend(args.log_dir or os.path.join(ROOT, ".cache", "logs"))
    log = backend.log_path(spec)
    if os.path.exists(log):
        os.unlink(log)  # a fresh log: the report reads the first plugin line
    console = stderr_console()
    print(f"engine {spec.name} ({cfg.name}): {spec.url}, log {log}", flush=True)
    try:
        with progress_bar(console) as progress:
            engine, ready = start_ready(backend, spec, cfg.rollout.budgets, RichView(progress),
                                        allow_unfixed=cfg.rollout.allow_unfixed)
    except (ReadinessError, EngineStartError) as e:  # the engine did not start: its log tail, one line, exit 1
        return start_failure(console, e)
    tree = engine.tree_pids()
    try:
        print_report(engine, ready)
        failed = bool(args.prompt) and not _sample(engine, args.prompt, args.max_new_tokens, cfg)
        if args.serve:
            where = f" (API key in the 0600 file {engine.procs[0].secret_path})" if spec.api_key else ""
            print(f"serving at {engine.url}{where}; Ctrl-C stops it", flush=True)
            while engine.alive():
                time.sleep(1)
    finally:
        engine.stop()
        print(f"stopped; processes left: {alive_pids(tree) or 'none'}")
    return 1 if failed else 0


def first_engine_spec(cfg, model: str, port: int):
    """The spec of a config's first engine (its first group's engine 0) on `port`; the others are dropped."""
    from rollout import config as rconfig

    group = cfg.engine_groups[0]
    cfg.engine_groups, group.engines = [group], 1
    return rconfig.engine_specs(cfg, model, ports=[port])[0]


def log_text(engine) -> str:
    """The whole server log of an engine's node 0."""
    try:
        with open(engine.log_path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def parse_startup_timings(text: str) -> Optional[dict]:
    """SGLang's own start-up phases (its 'Engine startup timings' line), or None."""
    m = _TIMINGS.search(text)
    if not m:
        return None
    return {"load_weight": float(m.group(1)), "kv_cache_allocation": float(m.group(2)),
            "scheduler_e2e": float(m.group(3)), "tokenizer_e2e": float(m.group(5))}


def print_report(engine, ready) -> None:
    from rollout.engines.process import rss

    text = log_text(engine)
    fixes = parse_active_fixes(text)
    print(f"plugin: {'not loaded' if fixes is None else 'active fixes: ' + (', '.join(fixes) or 'none')}")
    print(f"admitted after {ready.total_s:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in ready.phase_s.items()))
    timings = parse_startup_timings(text)
    if timings:
        print("SGLang start-up phases (s): " + ", ".join(f"{k}={v:.2f}" for k, v in timings.items()))
    else:
        print("SGLang start-up phases: no 'Engine startup timings' line in the log")
    mem = rss(engine.tree_pids())
    total = sum(b for _, b in mem.values())
    print(f"memory: {total / 2**30:.2f} GiB RSS over {len(mem)} processes")
    for pid, (name, b) in sorted(mem.items()):
        print(f"  {pid:>8}  {name:<24} {b / 2**30:.2f} GiB")


def _sample(engine, prompt: str, n: int, cfg) -> bool:
    """One greedy request, its answer (and its routed experts) printed; False (and one line) when the engine
    did not answer it."""
    import asyncio

    from rollout.engines.answer import parse
    from rollout.engines.client import EngineClient
    from rollout.errors import EngineError

    async def one() -> dict:
        async with EngineClient() as client:
            return await client.generate(engine, body, timeout_s=600)

    t0 = time.time()
    body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0},
            "return_routed_experts": engine.spec.group.routed_experts}
    try:
        answer = parse(engine.name, asyncio.run(one()))
    except EngineError as e:
        print(f"generate: failed: {e}")
        return False
    accept = answer.meta.get("spec_accept_length")
    extra = f", accept length {accept:.2f}" if isinstance(accept, (int, float)) else ""
    print(f"generate: {answer.completion_tokens} tokens in {time.time() - t0:.2f} s{extra}: {answer.text!r}")
    if engine.spec.group.routed_experts:
        print(routed_experts_line(answer, cfg))
    return True


def routed_experts_line(answer, cfg) -> str:
    """What the answer's routed experts decode to (the manager's decoder and checks), or why they do not."""
    from rollout.routed_experts.layout import MoELayout
    from rollout.routed_experts.merge import sample_routed_experts

    num_tokens = answer.prompt_tokens + answer.completion_tokens
    arr, reason = sample_routed_experts(answer.meta, num_tokens, MoELayout.from_model(cfg.model))
    if reason:
        return f"routed experts: refused: {reason}"
    return f"routed experts: {arr.shape[0]} rows x {arr.shape[1]} MoE layers x top-{arr.shape[2]} for {num_tokens} tokens"
