"""Parse argv lists with SGLang's own parser, in whatever interpreter runs this file.

stdin: JSON {"argvs": [[flag, ...], ...], "fields": [name, ...]}; stdout (last line): JSON list, one
{field: value} per argv. An argv containing `--config FILE` is merged the way `launch_server` does
(SGLang's ConfigArgumentMerger). Used by tests/test_engine_plan.py for every reviewed SGLang version.
"""
import argparse
import contextlib
import io
import json
import sys


def main():
    req = json.load(sys.stdin)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import sglang
        from sglang.srt.server_args import ServerArgs
        try:
            from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
        except ImportError:  # 0.5.15.post1, 0.5.16
            from sglang.srt.server_args_config_parser import ConfigArgumentMerger

    class Raising(argparse.ArgumentParser):
        def error(self, message):
            raise SystemExit(f"SGLang's parser rejects the flags: {message}")

    parser = Raising(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    out = []
    for argv in req["argvs"]:
        if "--config" in argv:
            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        ns = parser.parse_args(argv)
        out.append({f: getattr(ns, f, "<no such field>") for f in req["fields"]})
    print(json.dumps({"version": sglang.__version__, "parsed": out}))


if __name__ == "__main__":
    main()
