"""`slime-moe-rollout patches ...`: status of the fix set, a release review, applying the diffs to a source tree.

Bad input or a failed step prints one `error: ...` line and returns 2; sglang_patches needs nothing from
the rollout CLI for that.
"""
import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("patches", help="the SGLang fix set: status, review, apply-source")
    psub = p.add_subparsers(dest="patches_command", required=True)
    s = psub.add_parser("status", help="installed SGLang version and each fix's state")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_status)
    r = psub.add_parser("review", help="draft review of an SGLang release (from a checkout): fingerprints, "
                                       "scenarios stock vs plugin, verdicts")
    r.add_argument("version", help="SGLang version, e.g. 0.5.24 (needs requirements/sglang-VERSION.txt)")
    r.add_argument("--no-build", action="store_true", help="use the existing .venvs/sglang-VERSION")
    r.add_argument("--as", dest="review_as", default=None,
                   help="judge the tree as this reviewed variant (default: the nearest by fingerprints)")
    r.set_defaults(func=cmd_review)
    a = psub.add_parser("apply-source", help="git-apply the fix diffs onto an SGLang source tree")
    a.add_argument("--sglang-dir", required=True, help="an SGLang checkout (python/sglang) or a dir holding sglang/")
    a.add_argument("--version", default=None,
                   help="SGLang version or variant of that tree (default: the diff set that fits it)")
    a.add_argument("--check", action="store_true", help="only report what would be done")
    a.set_defaults(func=cmd_apply_source)


def _error(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


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


def cmd_review(args) -> int:
    from sglang_patches.review import ReviewError, review

    try:
        lines = review(args.version, build=not args.no_build, review_as=args.review_as)
    except ReviewError as e:
        return _error(e)
    print("\n".join(lines))
    return 0


def cmd_apply_source(args) -> int:
    from sglang_patches.diffs import ApplyError, apply_source

    try:
        for line in apply_source(args.sglang_dir, args.version, check_only=args.check):
            print(line)
    except ApplyError as e:
        return _error(e)
    return 0
