"""`serve --control-port P`: serve's own HTTP API beside the engines, for a trainer that is not slime.

    POST /update_weights {"model_path": DIR, "weight_version": V}
        every engine loads DIR while its requests stay in flight (`RolloutManager.update_weights_from_disk`:
        a retract-mode pause, flush, load, V published without aborting, continue); answers
        {"weight_version", "engines", "seconds"}. One update at a time (a second waits).
    GET /groups?after=SEQ&max=N&wait_s=S     (with `--num-groups N` or `--prompts FILE`)
        the finished groups serve rolls out, as `run` writes them (`group_record`, with `label` / `metadata`
        from a prompts file) plus `seq` (1, 2, ...): those with seq > SEQ, at most N, waiting up to S seconds
        for one. Passing `after=SEQ` acknowledges every group up to SEQ: they are dropped. A consumer that
        keeps its last seq gets every group once, even when an answer is lost (it asks again with the same
        SEQ). Answers {"groups", "next" (the last seq handed out), "done" (every group acknowledged or the
        rollout ended), "error", "weight_version"}.

Backpressure: at most `held` groups wait unacknowledged; the rollout waits meanwhile (no group dropped).
`rollout.max_weight_version_lag` bounds staleness as in slime's fully-async function (`versions.StaleGate`).
Across a weight update the groups in flight keep their tokens and resume under the new weights: none is
aborted or started again, and each sample's `weight_version_spans` says which version sampled which tokens.
Bad input: HTTP 400 and one line; a failed update: HTTP 500 and one line (the engines are resumed).
With `rollout.engine_auth: key` every call needs the engines' key (`Authorization: Bearer KEY`).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Optional

from aiohttp import web

from rollout.errors import one_line
from rollout.manager import group_record
from rollout.net import auth_headers
from rollout.stream import Once
from rollout.versions import StaleGate


class GroupFeed(Once):
    """The manager's sink for serve's rollout: finished groups numbered and held until acknowledged."""

    def __init__(self, extra: Optional[dict] = None, held: int = 64):
        super().__init__()
        self.extra, self.size = extra or {}, held
        self.held: deque = deque()     # (seq, record), oldest first
        self.seq = 0
        self.done, self.error = False, None
        self.changed = asyncio.Condition()

    async def put(self, group) -> bool:
        if not self.admit(group):
            return False
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.held) < self.size)
            self.seq += 1
            self.held.append((self.seq, {**group_record(group), **self.extra.get(group.group_id, {}),
                                         "seq": self.seq}))
            self.changed.notify_all()
        return True

    async def finish(self, error: Optional[str] = None) -> None:
        async with self.changed:
            self.done, self.error = True, error
            self.changed.notify_all()

    async def read(self, after: int, most: int, wait_s: float) -> list:
        """Drop what is acknowledged (seq <= `after`), then up to `most` records after it (waits for one)."""
        async with self.changed:
            while self.held and self.held[0][0] <= after:
                self.held.popleft()
            self.changed.notify_all()
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.done or self.held), wait_s)
            except asyncio.TimeoutError:
                pass
            return [r for s, r in self.held if s > after][:most]


def app(mgr, key: Optional[str], feed: Optional[GroupFeed]) -> web.Application:
    lock = asyncio.Lock()
    need = auth_headers(key).get("Authorization")

    @web.middleware
    async def auth(request, handler):
        if need and request.headers.get("Authorization") != need:
            return web.Response(status=401, text="missing or wrong API key (Authorization: Bearer KEY)\n")
        return await handler(request)

    async def update(request):
        try:
            body = await request.json()
            path, version = body["model_path"], str(body["weight_version"])
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400, text='body: give {"model_path": DIR, "weight_version": V}\n')
        if not isinstance(path, str) or not os.path.isdir(path):
            return web.Response(status=400, text=f"model_path: {path!r} is not a directory\n")
        async with lock:
            t0 = time.monotonic()
            try:
                names = await mgr.update_weights_from_disk(path, version)
            except Exception as e:   # the engines are resumed; the update is not applied everywhere
                return web.Response(status=500, text=f"weight update to {version!r} failed: {one_line(e)}\n")
        return web.json_response({"weight_version": version, "engines": names,
                                  "seconds": round(time.monotonic() - t0, 3)})

    async def groups(request):
        if feed is None:
            return web.Response(status=404, text="serve rolls out nothing: start it with --num-groups or --prompts\n")
        try:
            after, most = int(request.query.get("after", 0)), int(request.query.get("max", 16))
            wait_s = float(request.query.get("wait_s", 10))
        except ValueError:
            return web.Response(status=400, text="after, max: integers; wait_s: seconds\n")
        got = await feed.read(after, max(1, most), min(max(0.0, wait_s), 300.0))
        return web.json_response({"groups": got, "next": got[-1]["seq"] if got else after,
                                  "done": feed.done and not got,
                                  "error": feed.error, "weight_version": mgr.weight_version})

    a = web.Application(middlewares=[auth])
    a.router.add_post("/update_weights", update)
    a.router.add_get("/groups", groups)
    return a


async def start(mgr, host: str, port: int, key: Optional[str], feed: Optional[GroupFeed]) -> web.AppRunner:
    runner = web.AppRunner(app(mgr, key, feed), shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


class Control:
    """serve's API and, with prompts, its rollout (a task feeding `feed`); `close()` ends both."""

    def __init__(self, runner, task: Optional[asyncio.Task]):
        self.runner, self.task = runner, task

    @classmethod
    async def open(cls, mgr, cfg, args, prompts, extra: dict, key: Optional[str], say) -> "Control":
        feed = GroupFeed(extra) if prompts is not None else None
        runner = await start(mgr, cfg.rollout.host, args.control_port, key, feed)
        task = None
        if feed is not None:
            r = cfg.rollout
            task = asyncio.create_task(_roll(mgr, [mgr.new_group(p, index=i) for i, p in enumerate(prompts)], feed, say,
                                             getattr(r, "max_weight_version_lag", None),
                                             getattr(r, "stale_groups", "regenerate")))
        say(f"control: http://{cfg.rollout.host}:{args.control_port} (POST /update_weights"
            f"{f', GET /groups: {len(prompts)} group(s)' if feed else ''})")
        return cls(runner, task)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.runner.cleanup()


async def _roll(mgr, todo: list, feed: GroupFeed, say, lag=None, policy="regenerate") -> None:
    gate = StaleGate(feed, lag, policy, lambda: mgr.weight_version)   # rollout.max_weight_version_lag
    try:
        res = await mgr.rollout(todo, gate, batch_size=len(todo), refill=gate.refill)
    except Exception as e:   # every engine lost: the consumer reads the reason
        await feed.finish(one_line(e))
        say(f"rollout stopped: {one_line(e)}")
        return
    await feed.finish()
    say(f"rollout done: {res.delivered} group(s) delivered, {res.resent} request(s) re-sent, "
        f"{res.failed_samples} sample(s) failed" + (f"; stale groups: {gate.line()}" if lag is not None else ""))
