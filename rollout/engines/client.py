"""The one HTTP client of the engines: every call to an SGLang server (or to slime's router) goes here.

One policy for all: the engine's API key on every call (`net.auth_headers`), a connect timeout of
`CONNECT_S` and a total timeout per kind of call (`CONTROL_S`, `WEIGHTS_S`, `GENERATE_S`; a caller with a
deadline passes its own). One answer per call or one typed error saying what the caller may do
(`rollout.errors`): `EngineUnreachable` (no HTTP answer: retry elsewhere), `ApiKeyRejected` (401/403:
waiting will not fix it), `EngineRejected` (any other status but 200, with `status` and `body`).

    async with EngineClient() as client:
        out = await client.generate(engine, body)

`engine` is anything with `.name`, `.url` and `.api_key` (an `Engine`, an `Endpoint`).
"""
from __future__ import annotations

import asyncio
import functools
import json
from typing import Awaitable, Optional

import aiohttp

from rollout.errors import ApiKeyRejected, EngineRejected, EngineUnreachable, one_line
from rollout.net import auth_headers

CONNECT_S = 10.0
CONTROL_S = 10.0       # status, info, abort, pause/continue, flush
WEIGHTS_S = 600.0      # a weight update from disk
GENERATE_S = 3600.0    # one generation (a long response on a loaded engine)
REPEATABLE = ("/flush_cache", "/abort_request")   # POSTs sent again after a closed pooled connection


@functools.lru_cache(maxsize=64)
def _timeout(total_s: float) -> aiohttp.ClientTimeout:
    """One timeout object per duration (built once: the hot path sends thousands of requests a second)."""
    return aiohttp.ClientTimeout(total=max(0.1, total_s), sock_connect=CONNECT_S)


@functools.lru_cache(maxsize=256)
def _headers(api_key: Optional[str]) -> dict:
    return auth_headers(api_key)


WEIGHT_PATHS = ("disk", "tensor", "distributed")
SESSIONS_FROM = (0, 5, 21)   # tensor and distributed updates need /begin_weight_update ... /end_weight_update


def has_weight_sessions(version: str) -> bool:
    """Whether an SGLang release needs (and has) weight-update sessions: 0.5.21 and later."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) >= SESSIONS_FROM


class EngineClient:
    """One pooled HTTP session (opened on first use, on the running loop) for any number of engines."""

    def __init__(self):
        self._session: Optional[aiohttp.ClientSession] = None
        self._closed = False

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session; later calls raise `EngineUnreachable` (a task still polling gets no answer)."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ConnectionError("the engine client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def call(self, engine, method: str, path: str, *, json_body=None, params=None,
                   timeout_s: float = CONTROL_S, as_json: bool = True):
        """One request; the answer's JSON (or text with `as_json=False`) when it is 200, else a typed error.
        A POST that may be repeated (a cache flush, an abort) is sent once more on a fresh connection when
        the server closed the one it was sent on unanswered (uvicorn ends an idle keep-alive connection,
        and reusing it can race that); aiohttp does so itself for a GET."""
        for again in (path in REPEATABLE, False):
            try:
                async with self._open().request(method, engine.url + path, json=json_body, params=params,
                                                headers=_headers(engine.api_key), timeout=_timeout(timeout_s)) as r:
                    status, raw = r.status, await r.read()
                break
            except aiohttp.ServerDisconnectedError as e:
                if not again:
                    raise EngineUnreachable(engine.name, path, e) from None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise EngineUnreachable(engine.name, path, e) from None
        if status == 200 and as_json:
            try:
                return json.loads(raw)
            except ValueError:
                pass
        text = raw.decode("utf-8", "replace")
        if status in (401, 403):
            raise ApiKeyRejected(engine.name, path, status, text)
        if status != 200:
            raise EngineRejected(engine.name, path, status, text)
        if not as_json:
            return text
        raise EngineRejected(engine.name, path, status, f"not JSON: {one_line(text)}")

    # ------------------------------------------------------------------ generation
    def generate(self, engine, body: dict, timeout_s: float = GENERATE_S) -> Awaitable[dict]:
        """`call`'s awaitable itself (no coroutine of its own: one frame less on every request's resumptions)."""
        return self.call(engine, "POST", "/generate", json_body=body, timeout_s=timeout_s)

    async def abort_all(self, engine) -> None:
        await self.call(engine, "POST", "/abort_request", json_body={"abort_all": True}, as_json=False)

    # ------------------------------------------------------------------ status
    async def model_info(self, engine, timeout_s: float = CONTROL_S) -> dict:
        return await self.call(engine, "GET", "/model_info", timeout_s=timeout_s)

    async def weight_version(self, engine) -> Optional[str]:
        """The weight version the engine reports (`/model_info`), None when it names none."""
        return (await self.model_info(engine)).get("weight_version")

    async def server_info(self, engine, timeout_s: float = 30.0) -> dict:
        return await self.call(engine, "GET", "/server_info", timeout_s=timeout_s)

    async def ready(self, engine, timeout_s: float = CONTROL_S) -> None:
        """`/ready` 200: the server status is Up (SGLang 0.5.15.post1 / 0.5.16 answer 404: no such route)."""
        await self.call(engine, "GET", "/ready", timeout_s=timeout_s, as_json=False)

    async def health(self, engine, timeout_s: float = CONTROL_S) -> None:
        await self.call(engine, "GET", "/health", timeout_s=timeout_s, as_json=False)

    async def health_generate(self, engine, timeout_s: float = CONTROL_S) -> None:
        """200 after a one-token generation within SGLang's window; raises otherwise."""
        await self.call(engine, "GET", "/health_generate", timeout_s=timeout_s, as_json=False)

    async def loads(self, engine, timeout_s: float = CONTROL_S) -> list:
        """The scheduler's `/v1/loads` snapshot, one dict per DP rank."""
        return (await self.call(engine, "GET", "/v1/loads", params={"include": "core"},
                                timeout_s=timeout_s)).get("loads") or []

    # ------------------------------------------------------------------ weights and flow control
    async def update_weights_from_disk(self, engine, model_path: str, weight_version: str) -> None:
        """Target and draft model from a checkpoint (every reviewed release; no session needed), version published."""
        await self.call(engine, "POST", "/update_weights_from_disk", timeout_s=WEIGHTS_S, as_json=False,
                        json_body={"model_path": model_path, "weight_version": weight_version})

    async def update_weights_from_tensor(self, engine, serialized_named_tensors: list, weight_version: str,
                                         load_format: Optional[str] = None) -> None:
        """One bucket of tensors (one serialized entry per TP rank): on 0.5.21+ inside a session."""
        await self.call(engine, "POST", "/update_weights_from_tensor", timeout_s=WEIGHTS_S, as_json=False,
                        json_body={"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                                   "flush_cache": False, "weight_version": weight_version})

    async def update_weights_from_distributed(self, engine, names: list, dtypes: list, shapes: list,
                                              group_name: str, weight_version: str) -> None:
        """One broadcast bucket over an update group: on 0.5.21+ inside a session (which also loads the draft)."""
        await self.call(engine, "POST", "/update_weights_from_distributed", timeout_s=WEIGHTS_S, as_json=False,
                        json_body={"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": False, "weight_version": weight_version})

    async def init_weights_update_group(self, engine, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str = "nccl") -> None:
        """Join the engine's TP ranks (`rank_offset` ...) to the trainer's update group; answers once every rank of
        `world_size` joined (the trainer joins as rank 0 at the same time). `backend` "gloo" for CPU engines."""
        await self.call(engine, "POST", "/init_weights_update_group", timeout_s=WEIGHTS_S, as_json=False,
                        json_body={"master_address": master_address, "master_port": master_port,
                                   "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
                                   "backend": backend})

    async def destroy_weights_update_group(self, engine, group_name: str) -> None:
        await self.call(engine, "POST", "/destroy_weights_update_group", json_body={"group_name": group_name},
                        timeout_s=WEIGHTS_S, as_json=False)

    async def begin_weight_update(self, engine) -> None:
        """Open a weight-update session on every runner, target and draft (0.5.21+)."""
        await self.call(engine, "POST", "/begin_weight_update", json_body={"selector": "all"}, timeout_s=WEIGHTS_S,
                        as_json=False)

    async def end_weight_update(self, engine) -> None:
        await self.call(engine, "POST", "/end_weight_update", json_body={}, timeout_s=WEIGHTS_S, as_json=False)

    async def update_weight_version(self, engine, weight_version: str) -> None:
        """Publish a version without aborting the requests in flight (SGLang aborts them by default)."""
        await self.call(engine, "POST", "/update_weight_version", as_json=False,
                        json_body={"new_version": weight_version, "abort_all_requests": False})

    async def sglang_version(self, engine) -> str:
        """The engine's SGLang release (`/server_info`'s `version`)."""
        return str((await self.server_info(engine)).get("version") or "")

    async def update_weights(self, engine, send, weight_version: str, path: str = "tensor") -> None:
        """One weight update that keeps the requests in flight: pause in retract mode, flush, `await send()` (the
        update calls of `path`: disk, tensor or distributed), publish the version without aborting, continue.
        Tensor and distributed sends run inside a session where the engine's release has them (0.5.21+: the
        session also loads the draft model); a disk update needs none on any release (it loads target and
        draft). The engine is resumed whatever `send` raises."""
        if path not in WEIGHT_PATHS:
            raise ValueError(f"weight update path {path!r}: one of {', '.join(WEIGHT_PATHS)}")
        sessions = path != "disk" and has_weight_sessions(await self.sglang_version(engine))
        await self.pause_generation(engine, "retract")
        try:
            await self.flush_cache(engine)
            if sessions:
                await self.begin_weight_update(engine)
                try:
                    await send()
                finally:
                    await self.end_weight_update(engine)
            else:
                await send()
            await self.update_weight_version(engine, weight_version)
        finally:
            await self.continue_generation(engine)

    async def pause_generation(self, engine, mode: str = "abort") -> None:
        await self.call(engine, "POST", "/pause_generation", json_body={"mode": mode}, as_json=False)

    async def continue_generation(self, engine) -> None:
        await self.call(engine, "POST", "/continue_generation", json_body={}, as_json=False)

    async def flush_cache(self, engine) -> None:
        await self.call(engine, "POST", "/flush_cache", as_json=False)

    # ------------------------------------------------------------------ slime's router
    async def list_workers(self, router) -> list:
        """slime's router's `GET /workers` -> its worker dicts (sglang-router 0.3.x: {"workers": [{"url",
        "worker_type", "is_healthy", ...}], ...}; older builds: a plain list)."""
        body = await self.call(router, "GET", "/workers")
        items = body.get("workers", []) if isinstance(body, dict) else body
        return [w if isinstance(w, dict) else {"url": w} for w in items or []]
