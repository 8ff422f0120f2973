"""`slime-moe-rollout patches ...`: status of the fix set, a release review, applying the diffs to a source tree.

Bad input or a failed step raises `errors.CliError` (`ReviewError`, `ApplyError`): the console script
prints one `error: ...` line and exits 2.
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


def cmd_status(args) -> int:
    from sglang_patches.errors import CliError
    from sglang_patches.plugin import PLUGIN_NAME
    from sglang_patches.registry import VARIANTS, sglang_version
    from sglang_patches.status import collect

    if sglang_version() is None:
        raise CliError(f"SGLang is not installed in this Python ({sys.executable}); the fixes apply to a reviewed "
                       f"release: {', '.join(v.name for v in VARIANTS)}")
    status = collect()
    if args.json:
        print(json.dumps(status.as_dict(), indent=2))
    else:
        variant = status.variant or f"no reviewed variant: {status.variant_problem}"
        print(f"SGLang {status.sglang_version} (variant {variant}); plugin {PLUGIN_NAME}: "
              f"{status.plugin_problem or 'entry point installed'}")
        for v in status.verdicts:
            print(f"  {v.fix.name:<28} {v.fix.family:<13} {v.state.value:<10} {v.reason}")
    if not status.ok:
        bad = [v.fix.name for v in status.verdicts if not v.satisfied]
        print(f"error: fixes not active: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def cmd_review(args) -> int:
    from sglang_patches.review import review

    print("\n".join(review(args.version, build=not args.no_build, review_as=args.review_as)))
    return 0


def cmd_apply_source(args) -> int:
    from sglang_patches.diffs import apply_source

    for line in apply_source(args.sglang_dir, args.version, check_only=args.check):
        print(line)
    return 0
