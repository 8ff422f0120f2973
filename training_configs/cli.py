"""`slime-moe-rollout config check FILE`, `config render FILE --format ...` and `config schema`."""
from __future__ import annotations

import json

FORMATS = ("slime-args", "sglang-args", "external-addrs")


def add_parser(sub) -> None:
    p = sub.add_parser("config", help="check or render a training config (YAML)")
    csub = p.add_subparsers(dest="config_command", required=True)

    c = csub.add_parser("check", help="validate a config with SGLang's own rules; exit 2 on an error")
    c.add_argument("file")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--no-sglang", action="store_true",
                   help="derive with our copy of SGLang 0.5.23's rules (fix states still come from the installed SGLang)")
    c.add_argument("--require-fixes", action="store_true",
                   help="exit 1 when a fix the config needs is not active in this environment")
    c.set_defaults(func=_check)

    r = csub.add_parser("render", help="print the flags slime or SGLang expect")
    r.add_argument("file")
    r.add_argument("--format", required=True, choices=FORMATS)
    r.add_argument("--group", help="engine group (sglang-args; default: every group)")
    r.add_argument("--mode", choices=("plugin", "managed"),
                   help="slime-args: who launches the engines (default: slime.integration)")
    r.set_defaults(func=_render)

    s = csub.add_parser("schema", help="print the JSON schema of a config file (for editors)")
    s.set_defaults(func=_schema)


def _check(args) -> int:
    from training_configs.check import check_file, format_report
    rep = check_file(args.file, use_sglang=not args.no_sglang)
    print(json.dumps(rep.to_dict(), indent=1, default=str) if args.json else format_report(rep))
    if args.require_fixes:
        if not all(v.satisfied for g in rep.groups for v in g.fixes):
            return 1
    return 0


def _render(args) -> int:
    from training_configs.render import render
    from training_configs.schema import ConfigError, load_config
    cfg = load_config(args.file)
    if args.group:
        try:
            cfg.group(args.group)
        except KeyError:
            raise ConfigError(f"{args.file}: no engine group named {args.group!r}") from None
    print(render(cfg, args.format, group=args.group, mode=args.mode))
    return 0


def _schema(args) -> int:
    from training_configs.schema import json_schema

    print(json.dumps(json_schema(), indent=1))
    return 0
