"""Every HTTP worker of an engine with --tokenizer-worker-num > 1 loads the plugin.

Defect: with more than one tokenizer worker SGLang serves HTTP from worker processes that the main process starts
by an import string (uvicorn's ``workers=N``: ``"sglang.srt.entrypoints.http_server:app"``, a literal up to 0.5.22,
``SGLANG_HTTP_SERVER_APP_PATH`` on 0.5.23); each builds its own tokenizer manager in `init_multi_tokenizer`, which
never calls `load_plugins()` (sglang#38464, every reviewed release). The tokenizer-side hooks are then absent where
the answers are made: no compact routed-experts advert in `/server_info`, no retraction stamp, no fix report, while
the scheduler-side hooks run.

Fix (one wrapper): AROUND `http_server._setup_and_run_http_server` (the main process, where the plugin is loaded):
for the call, the workers' import string is `WORKER_APP` (`sglang_patches.worker_app:app`: `load_plugins()`, then
SGLang's own `app`), through ``SGLANG_HTTP_SERVER_APP_PATH`` when the user left it at SGLang's default (0.5.23) and
through the app string `uvicorn.run` is handed (every release). A user's own app path is left alone, with one log
line (that app must call `load_plugins()` itself); HTTP/2 workers (Granian) before 0.5.23 are not covered (one
log line). One tokenizer worker (the default) is untouched: SGLang serves its in-process app.
"""
import contextlib
import logging
import os

from sglang_patches.registry import Fix, Hook

SETUP = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
SGLANG_APP = "sglang.srt.entrypoints.http_server:app"
WORKER_APP = "sglang_patches.worker_app:app"
APP_ENV = "SGLANG_HTTP_SERVER_APP_PATH"   # 0.5.23: the import string of the workers' app

logger = logging.getLogger("slime_moe_rollout")


def _workers(server_args) -> int:
    try:
        return int(getattr(server_args, "tokenizer_worker_num", 1) or 1)
    except (TypeError, ValueError):
        return 1


@contextlib.contextmanager
def worker_app(server_args):
    """For the call: the HTTP workers import `WORKER_APP` instead of SGLang's app string."""
    import uvicorn

    if _workers(server_args) <= 1:
        yield
        return
    user = os.environ.get(APP_ENV)
    if user not in (None, "", SGLANG_APP):
        logger.warning("slime-moe-rollout tokenizer-workers: %s=%s is your own app: it must call "
                       "sglang.srt.plugins.load_plugins() for the fixes to reach the HTTP workers", APP_ENV, user)
    if getattr(server_args, "enable_http2", False) and user is None:
        logger.warning("slime-moe-rollout tokenizer-workers: HTTP/2 workers (Granian) load the plugin only where "
                       "SGLang reads %s (0.5.23)", APP_ENV)
    run = uvicorn.run

    def run_with_plugin(app, *args, **kwargs):
        return run(WORKER_APP if app == SGLANG_APP else app, *args, **kwargs)

    if user in (None, ""):
        os.environ[APP_ENV] = WORKER_APP
    uvicorn.run = run_with_plugin
    try:
        yield
    finally:
        uvicorn.run = run
        if user in (None, ""):
            os.environ.pop(APP_ENV, None)


def load_in_workers(original, *args, **kwargs):
    """AROUND _setup_and_run_http_server(server_args, ...)."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    try:
        ctx = worker_app(server_args)
        ctx.__enter__()
    except Exception as e:  # noqa: BLE001 - SGLang serves as it would without the fix
        logger.warning("slime-moe-rollout tokenizer-workers: not applied (%s: %s); the HTTP workers run without "
                       "the plugin", type(e).__name__, e)
        return original(*args, **kwargs)
    try:
        return original(*args, **kwargs)
    finally:
        ctx.__exit__(None, None, None)


LOAD = Hook(SETUP, load_in_workers)


def _needed(args: dict) -> bool:
    try:
        return int(args.get("tokenizer_worker_num") or 1) > 1
    except (TypeError, ValueError):
        return False


FIX = Fix(
    name="tokenizer-workers",
    family="r3",
    defect=(
        "With --tokenizer-worker-num > 1 the HTTP workers never load plugins (init_multi_tokenizer), so the "
        "tokenizer-side fixes (retraction stamp, compact routed-experts advert, fix report) are absent there."
    ),
    reference="sglang#38464 (open)",
    test="tests/test_tokenizer_workers.py",
    needed=_needed,
)
