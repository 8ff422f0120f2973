"""`slime-moe-rollout engine ...`: build the tiny model, launch real SGLang on CPU and report on it."""
import os
import time


def add_parser(sub) -> None:
    from rollout.engines.engine_launch import PRESETS
    from rollout.tiny_model import VARIANTS

    p = sub.add_parser("engine", help="real SGLang on CPU: tiny model, launch, start-up report")
    esub = p.add_subparsers(dest="engine_command", required=True, parser_class=type(p))

    b = esub.add_parser("build-model", help="write the tiny GLM-4.5 MoE checkpoint (idempotent)")
    b.add_argument("--variant", choices=VARIANTS, default="random")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--path", default=None, help="output folder (default: <repo>/.cache/tiny-glm45[-match])")
    b.set_defaults(func=_build)

    la = esub.add_parser("launch", help="start an engine configuration, print start-up phases and memory, stop it")
    la.add_argument("--config", choices=sorted(PRESETS), required=True,
                    help="; ".join(f"{k}: {v}" for k, v in sorted(PRESETS.items())))
    la.add_argument("--model-path", default=None, help="checkpoint folder (default: the tiny model, built if needed)")
    la.add_argument("--variant", choices=VARIANTS, default=None,
                    help="tiny-model variant (default: always-match with NEXTN, else random)")
    la.add_argument("--log", default=None, help="server log file (default: .cache/logs/engine-<config>.log)")
    la.add_argument("--budget", type=float, default=600.0, help="seconds to wait for readiness")
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


def _build(args) -> int:
    from rollout.tiny_model import build_tiny_glm

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
    except (rconfig.ConfigError, ValueError) as e:
        raise CliError(str(e).splitlines()[0]) from None
    nodes = sum(len(e) for e in engines)
    print(f"# {cfg.name}: {len(engines)} engine(s), {nodes} node command(s), device {cfg.cluster.device}; "
          f"node 0 of each engine serves HTTP; the API key goes in a 0600 file passed with --config")
    for cmds in engines:
        for c in cmds:
            print(f"# engine {c.engine} node {c.node_rank}/{c.nnodes} on {c.host}")
            print(c.shell())
    return 0


def _launch(args) -> int:
    from rollout.cli import CliError
    from rollout.engines.engine_launch import launch, preset
    from rollout.tiny_model import build_tiny_glm, default_path

    if args.budget <= 0 or args.max_new_tokens < 1:
        raise CliError("--budget and --max-new-tokens must be positive")
    model = args.model_path
    if model is None:
        variant = args.variant or ("always-match" if args.config in ("b", "c") else "random")
        model = build_tiny_glm(default_path(variant), variant=variant)
    elif not os.path.isfile(os.path.join(model, "config.json")):
        raise CliError(f"--model-path {model}: no config.json there")
    env = {}
    if args.no_plugin:
        env["SGLANG_PLUGINS"] = "none"
    if args.disable:
        env["SLIME_MOE_ROLLOUT_DISABLE"] = args.disable
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = args.log or os.path.join(root, ".cache", "logs", f"engine-{args.config}.log")
    eng = launch(preset(args.config, model, env=env), log)
    print(f"engine {args.config}: pid {eng.pid}, {eng.url}, log {log}")
    try:
        ready = _wait(eng, args.budget)
        print_report(eng, ready)
        if args.prompt:
            _sample(eng, args.prompt, args.max_new_tokens)
        if args.serve:
            print(f"serving at {eng.url} (API key in the 0600 file {eng.proc.secret_path}); Ctrl-C stops it")
            while eng.alive():
                time.sleep(1)
    except (RuntimeError, TimeoutError) as e:
        raise CliError(str(e).splitlines()[0]) from None
    finally:
        left = eng.stop()
        print(f"stopped; processes left: {left or 'none'}")
    return 0


def _wait(eng, budget: float) -> float:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("waiting for the engine"), BarColumn(), TimeElapsedColumn(),
                  TextColumn(f"budget {budget:.0f} s")) as prog:
        task = prog.add_task("start", total=budget)
        return eng.wait_ready(budget, on_tick=lambda t: prog.update(task, completed=min(t, budget)))


def print_report(eng, ready_s: float) -> None:
    fixes = eng.active_fixes()
    print(f"plugin: {'not loaded' if fixes is None else 'active fixes: ' + (', '.join(fixes) or 'none')}")
    print(f"ready (first /health 200) after {ready_s:.1f} s")
    timings = eng.startup_timings()
    if timings:
        print("start-up phases (s): " + ", ".join(f"{k}={v:.2f}" for k, v in timings.items()))
    else:
        print("start-up phases: no 'Engine startup timings' line in the log")
    mem = eng.memory()
    total = sum(rss for _, rss in mem.values())
    print(f"memory: {total / 2**30:.2f} GiB RSS over {len(mem)} processes")
    for pid, (name, rss) in sorted(mem.items()):
        print(f"  {pid:>8}  {name:<24} {rss / 2**30:.2f} GiB")


def _sample(eng, prompt: str, n: int) -> None:
    import requests

    t0 = time.time()
    body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0},
            "return_routed_experts": bool(eng.opts.routed_experts)}
    r = requests.post(eng.url + "/generate", headers=eng.headers(), json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    meta = out.get("meta_info", {})
    extra = ""
    if "spec_accept_length" in meta:
        extra = f", accept length {meta['spec_accept_length']:.2f}"
    print(f"generate: {len(out.get('output_ids', []))} tokens in {time.time() - t0:.2f} s{extra}: {out.get('text')!r}")
