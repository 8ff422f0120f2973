"""`slime-moe-rollout` console script: one parser, sub-commands contributed by each area."""
import argparse
import importlib
import sys

from rollout.errors import CliError, one_line

# (command, module exposing add_parser(subparsers)) - each module owns its sub-command.
COMMANDS = [
    ("patches", "sglang_patches.cli"),
    ("config", "training_configs.cli"),
    ("run", "rollout.cli.run"),
    ("engine", "rollout.cli.engine"),
    ("serve", "rollout.cli.serve"),
    ("r3", "rollout.cli.r3"),
]


def positive_int(text: str) -> int:
    """argparse type of a count: a one-line error for anything but an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def port(text: str) -> int:
    """argparse type of an engine's (base) port: an integer in the config's `rollout.base_port` range."""
    from training_configs.schema import BASE_PORTS

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not BASE_PORTS[0] <= n <= BASE_PORTS[1]:
        raise argparse.ArgumentTypeError(f"must be in [{BASE_PORTS[0]}, {BASE_PORTS[1]}], got {n}")
    return n


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CliError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="slime-moe-rollout", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # area not built yet
        mod.add_parser(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except CliError as e:  # the one failure path of every sub-command: bad input, one line, exit 2
        print(f"error: {one_line(e, None)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
