"""`slime-moe-rollout patches ...`: status of the fix set, and applying the diffs to a source tree."""
import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("patches", help="the SGLang fix set: status, apply-source")
    psub = p.add_subparsers(dest="patches_command", required=True)
    s = psub.add_parser("status", help="installed SGLang version and each fix's state")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_status)
    a = psub.add_parser("apply-source", help="git-apply the fix diffs onto an SGLang source tree")
    a.add_argument("--sglang-dir", required=True, help="an SGLang checkout (python/sglang) or a dir holding sglang/")
    a.add_argument("--version", default="0.5.23", help="SGLang version of that tree (default 0.5.23)")
    a.add_argument("--check", action="store_true", help="only report what would be done")
    a.set_defaults(func=cmd_apply_source)


def cmd_status(args) -> int:
    from sglang_patches.status import GOOD_STATES, collect

    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        variant = report["variant"] or f"no reviewed variant: {report['variant_problem']}"
        print(f"SGLang {report['sglang_version'] or '(not installed)'} (variant {variant}); plugin {report['plugin']}: "
              f"{report['plugin_problem'] or 'entry point installed'}")
        for r in report["fixes"]:
            print(f"  {r['name']:<28} {r['family']:<13} {r['state']:<10} {r['reason']}")
    if not report["ok"]:
        bad = [r["name"] for r in report["fixes"] if r["state"] not in GOOD_STATES]
        print(f"error: fixes not active: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def cmd_apply_source(args) -> int:
    from rollout.cli import CliError
    from sglang_patches.diffs import ApplyError, apply_source

    try:
        for line in apply_source(args.sglang_dir, args.version, check_only=args.check):
            print(line)
    except ApplyError as e:
        raise CliError(str(e)) from None
    return 0
