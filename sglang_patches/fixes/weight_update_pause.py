"""A weight update paused the way slime pauses keeps the requests in flight instead of aborting them.

Defect: slime pauses every engine at each weight update with ``POST /pause_generation`` and an empty body,
then ``/flush_cache``, the update, ``/continue_generation``. An empty body is SGLang's "abort" mode on every
reviewed release: every request in flight is aborted, and slime's fully-async worker generates those groups
again (or continues them with tokens of several weight versions). Two more traps stand in the way of keeping
them: before 0.5.21 ``Scheduler.flush_cache`` refuses while retracted requests wait in the queue (slime retries
60 s, then raises; the update from disk asserts "Cache flush failed after updating weights", miles#1497), and
``/update_weight_version`` aborts every request by default (miles#2372: 16 of 16 aborted after a retract pause).

Fix (surgical wrappers; the mode is `ENV`, else retract where the engine returns routed experts, else abort):
- BEFORE ``TokenizerManager.pause_generation``: an abort-mode pause becomes a retract-mode pause. The running
  requests go back to the waiting queue with their tokens and resume under the new weights after
  ``/continue_generation`` (their KV is recomputed, so no stale KV and no stale prefix cache is served; the
  routed experts of their tokens are kept by `retraction-rows`).
- AROUND ``Scheduler.flush_cache`` (0.5.15.post1-0.5.20): while the engine is paused, the waiting queue is set
  aside for SGLang's own flush and put back unchanged, as 0.5.21+ does itself (``is_fully_idle(ignore_waiting=
  self._engine_paused)``). Retracted requests hold no KV and no radix node, so the flush empties the cache the old
  weights filled; a running batch still refuses it, as stock.
- AROUND ``TokenizerManager.abort_request``: in retract mode the abort-all that SGLang's ``/update_weight_version``
  handler sends (``abort_all_requests`` defaults to true) is dropped, one log line; the version is published.
  Every other abort (``/abort_request``, a client disconnect, an abort-mode pause) passes.

Each answer's weight versions: 0.5.19+ report them per token range themselves (``meta_info["weight_versions"]``);
before 0.5.19 ``meta_info["weight_version"]`` is the version at finish only (not changed here).
"""
import logging
import os
import sys

from sglang_patches.registry import Fix, Hook

PAUSE = "sglang.srt.managers.tokenizer_manager.TokenizerManager.pause_generation"
ABORT = "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request"
FLUSH = "sglang.srt.managers.scheduler.Scheduler.flush_cache"
VERSION_HANDLER = ("update_weight_version", os.path.join("entrypoints", "http_server.py"))

ENV = "SLIME_MOE_ROLLOUT_WEIGHT_UPDATE_PAUSE"
RETRACT, ABORT_MODE = "retract", "abort"
MODES = (RETRACT, ABORT_MODE)

logger = logging.getLogger("slime_moe_rollout")
_said = set()


def _once(key: str, msg: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning(msg, *args)


def pause_mode(server_args) -> str:
    """`ENV` (retract | abort), else retract where the engine returns routed experts, else abort."""
    raw = os.environ.get(ENV, "").strip()
    if raw in MODES:
        return raw
    if raw:
        _once("env", "slime-moe-rollout weight-update-pause: %s=%r is not one of %s; using the default", ENV, raw,
              " | ".join(MODES))
    return RETRACT if getattr(server_args, "enable_return_routed_experts", False) else ABORT_MODE


def retract_on_pause(self, obj, *args, **kwargs):
    """BEFORE TokenizerManager.pause_generation: abort mode -> retract mode where the mode says so."""
    try:
        if getattr(obj, "mode", None) == ABORT_MODE and pause_mode(self.server_args) == RETRACT:
            obj.mode = RETRACT
            _once("pause", "slime-moe-rollout weight-update-pause: /pause_generation in abort mode pauses in "
                           "retract mode (%s): requests in flight resume after /continue_generation", ENV)
    except Exception as e:  # noqa: BLE001 - the pause runs as SGLang's
        logger.warning("slime-moe-rollout weight-update-pause: reading the pause failed (%s: %s); it runs as "
                       "SGLang's", type(e).__name__, e)
    return None


def _from_version_handler(depth: int = 6) -> bool:
    """Whether SGLang's /update_weight_version handler is the caller (a few frames up)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == VERSION_HANDLER[0] and code.co_filename.endswith(VERSION_HANDLER[1]):
            return True
        frame = frame.f_back
    return False


def keep_on_version_abort(original, self, *args, **kwargs):
    """AROUND TokenizerManager.abort_request: drop the abort-all of /update_weight_version in retract mode."""
    try:
        abort_all = kwargs.get("abort_all", args[1] if len(args) > 1 else False)
        drop = abort_all and pause_mode(self.server_args) == RETRACT and _from_version_handler()
    except Exception as e:  # noqa: BLE001 - the abort runs as SGLang's
        logger.warning("slime-moe-rollout weight-update-pause: reading the abort failed (%s: %s)", type(e).__name__, e)
        drop = False
    if drop:
        _once("version", "slime-moe-rollout weight-update-pause: /update_weight_version publishes the version "
                         "without aborting the requests in flight (%s=retract)", ENV)
        return None
    return original(self, *args, **kwargs)


def flush_while_paused(original, self, *args, **kwargs):
    """AROUND Scheduler.flush_cache (before 0.5.21): a paused engine flushes with retracted requests waiting."""
    queue = getattr(self, "waiting_queue", None)
    if not getattr(self, "_engine_paused", False) or not queue or not isinstance(queue, list):
        return original(self, *args, **kwargs)
    held = list(queue)
    queue.clear()
    try:
        return original(self, *args, **kwargs)
    finally:
        queue[:0] = held


RETRACT_PAUSE = Hook(PAUSE, retract_on_pause, "before")
KEEP_ON_VERSION = Hook(ABORT, keep_on_version_abort)
FLUSH_PAUSED = Hook(FLUSH, flush_while_paused)

FIX = Fix(
    name="weight-update-pause",
    family="weight-update",
    defect=(
        "slime's weight update pauses with an empty body (abort mode): every request in flight is aborted; "
        "before 0.5.21 a flush with retracted requests waiting is refused, and /update_weight_version aborts "
        "every request by default."
    ),
    reference="miles#2372, miles#1497, miles#2782, slime#2092",
    test="tests/test_weight_update_pause.py::test_weight_update_pause_on_variant",
)
