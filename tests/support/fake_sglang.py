"""The one FAKE SGLang server of the tests: SGLang's HTTP API without an engine, where a real engine is too slow
for what a test checks (manager logic, the slime adapter, dispatcher cancellation, probe timing).

An aiohttp app served on a free loopback port, in its own thread and event loop (`start()`: callers may be
synchronous, as slime is) or in the caller's loop (`await serve()`). Every route answers as real SGLang 0.5.23
was recorded answering (tests/facts/, written by tests/record_real_answers.py): /model_info, /ready,
/server_info (the recorded fields), /health_generate, /abort_request, and /generate through `answer()`, which
fills a finished request's meta_info with the recorded keys. A test passes its own handler for a route
(`routes={"/generate": handler}`, POST for /generate, /abort_request and the pause / weight routes (`POST`),
GET otherwise) for the behaviour it
needs; handlers are looked up per request, so a test may also swap one while the server runs.
"""
import asyncio
import json
import threading

from aiohttp import web

from support import ROOT

FACTS = ROOT / "tests" / "facts"
POST = ("/generate", "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
        "/update_weights_from_disk", "/update_weight_version")


def fact(name: str) -> dict:
    """tests/facts/sglang-0.5.23-<name>.json (or the file `name` itself when it ends in .json)."""
    path = FACTS / (name if name.endswith(".json") else f"sglang-0.5.23-{name}.json")
    return json.loads(path.read_text())


def answer(output_ids: list, finish: dict, *, logprob: float = -1.0, weight_version: str = "default",
           prompt_tokens: int = 0, routed_experts: str = None, **meta) -> dict:
    """A /generate body as SGLang 0.5.23 answers a finished request: `output_ids` and a meta_info with the
    recorded keys (routed experts only when asked for; `meta` adds or replaces fields)."""
    info = {"cached_tokens": 0, "cached_tokens_details": None, "completion_tokens": len(output_ids), "dp_rank": None,
            "e2e_latency": 0.01, "finish_reason": finish, "id": "fake", "input_token_logprobs": [],
            "num_retractions": 0, "output_token_logprobs": [[logprob, t, None] for t in output_ids],
            "output_token_logprobs_length": len(output_ids), "prompt_tokens": prompt_tokens,
            "reasoning_tokens": 0, "response_sent_to_client_ts": 0.0, "weight_version": weight_version,
            "weight_versions": []}
    if routed_experts is not None:
        info["routed_experts"] = routed_experts
    info.update(meta)
    return {"output_ids": list(output_ids), "meta_info": info}


def queued_abort_answer() -> dict:
    """What SGLang 0.5.23 answers a request aborted while still queued (recorded): no tokens, no routed experts."""
    rec = fact("abort")["queued"][0]
    body = answer([], rec["finish_reason"])
    body["meta_info"] = {k: v for k, v in body["meta_info"].items() if k in rec["meta_info_keys"]}
    assert set(body["meta_info"]) == set(rec["meta_info_keys"]), "fake out of date with tests/facts"
    return body


def _recorded_keys_hold():
    """The finished answer's keys are the recorded running request's (checked once, at import)."""
    rec = fact("abort")["running"]
    got = set(answer([1], rec["finish_reason"], routed_experts="")["meta_info"])
    assert got == set(rec["meta_info_keys"]), f"fake out of date with tests/facts: {got ^ set(rec['meta_info_keys'])}"


_recorded_keys_hold()


class Loopback:
    """An aiohttp app of `routes` ({path: async handler(request)}; POST for the paths in `POST`, GET
    otherwise) on a free loopback port: in a thread of its own (`start()`) or the caller's loop (`await serve()`)."""

    def __init__(self, routes, *, host="127.0.0.1", port=0, shutdown_timeout=0.1, handler_cancellation=True):
        self.routes, self.host, self.port = dict(routes), host, port
        self._kw = dict(shutdown_timeout=shutdown_timeout, handler_cancellation=handler_cancellation)
        self.runner = self.loop = self.thread = None

    url = property(lambda self: f"http://{self.host}:{self.port}")

    def _app(self):
        app = web.Application()
        for path in self.routes:
            async def handler(request, path=path):  # looked up per request
                return await self.routes[path](request)

            (app.router.add_post if path in POST else app.router.add_get)(path, handler)
        return app

    async def serve(self):
        """Serve in the running loop; `await self.cleanup()` stops."""
        self.runner = web.AppRunner(self._app(), **self._kw)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def cleanup(self):
        await self.runner.cleanup()

    def start(self):
        """Serve in a thread of its own; `stop()` ends it."""
        ready = threading.Event()

        def main():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.serve())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def drop(self):
        """Like kill -9: the server vanishes, open connections are dropped (the thread's loop keeps running)."""
        asyncio.run_coroutine_threadsafe(self.cleanup(), self.loop).result(10)

    def stop(self):
        self.drop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


REPORT_KEY = "slime_moe_rollout.fixes"
GOOD_REPORT = {"sglang_version": "0.5.23", "refusal": None, "fixes": []}


class FakeSGLang(Loopback):
    """FAKE SGLang server: the recorded answers, `routes` replacing or adding routes."""

    def __init__(self, routes=None, *, server_info=None, **kw):
        self.server_info = dict(server_info or fact("abort")["server_info"])
        # what our plugin adds on a reviewed release with every needed fix good (sglang_patches.report)
        self.server_info.setdefault("internal_states", [{REPORT_KEY: GOOD_REPORT}])
        super().__init__({"/model_info": self.model_info, "/ready": self.ok, "/server_info": self.server_info_route,
                          "/health_generate": self.ok, "/abort_request": self.ok, "/generate": self.generate,
                          **(routes or {})}, **kw)

    async def model_info(self, request):
        return web.json_response({"weight_version": "default"})

    async def server_info_route(self, request):
        return web.json_response(self.server_info)

    async def ok(self, request):
        return web.Response(status=200)

    async def generate(self, request):
        body = await request.json()
        n = body.get("sampling_params", {}).get("max_new_tokens", 1)
        return web.json_response(answer([7] * n, {"type": "length", "length": n}))
