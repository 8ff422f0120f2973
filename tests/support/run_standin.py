"""`slime-moe-rollout run` in this process against a STAND-IN engine (a FAKE SGLang HTTP server in a thread,
tests/support/fake_sglang.py) instead of the config's launched engines: the CLI, the stream, the group log
and the manager are real. Used by tests/test_run_stops.py as a child process.

Environment: STANDIN_DELAY_S (each /generate waits this long), STANDIN_FSIZE (RLIMIT_FSIZE in bytes with
SIGXFSZ ignored, so a write past it fails with a real EFBIG, as a full disk fails with ENOSPC).
On stderr: `STANDIN: stopped after N generate calls` when the manager's stop() ran.
"""
import asyncio
import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.fake_sglang import FakeSGLang  # noqa: E402

from rollout import manager  # noqa: E402
from rollout.cli import main  # noqa: E402
from rollout.types import Endpoint  # noqa: E402

DELAY_S = float(os.environ.get("STANDIN_DELAY_S", "0"))
calls = 0


class CountingFake(FakeSGLang):
    async def generate(self, request):
        global calls
        calls += 1
        await asyncio.sleep(DELAY_S)
        return await super().generate(request)


def from_config(cfg, backend, model_path, *, run_id=None, client=None, **fleet):
    mgr = manager.RolloutManager(manager.engine_source(endpoints=[Endpoint("e0", engine.url, "")]),
                                 manager.RolloutOptions.from_config(cfg, run_id), client)
    stop = mgr.stop

    async def stop_and_say():
        await stop()
        print(f"STANDIN: stopped after {calls} generate calls", file=sys.stderr, flush=True)

    mgr.stop = stop_and_say
    return mgr


if __name__ == "__main__":
    engine = CountingFake().start()
    manager.RolloutManager.from_config = staticmethod(from_config)
    if os.environ.get("STANDIN_FSIZE"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(os.environ["STANDIN_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    rc = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(rc)
