"""A STAND-IN SGLang whose weights change while requests run (tests/support/fake_sglang.py's server, plus the pause
and weight routes), where a real engine is too slow for what a test checks (the manager's, `run`'s and `serve`'s
side of a weight update mid-rollout; tests/test_serve_weight_update_engine.py runs the real one).

As SGLang 0.5.23 behaves: each /generate makes one token per `tick_s` up to `max_new_tokens`; `/pause_generation`
in mode `abort` (and an empty body, SGLang's default) ends every request with finish `abort` and its tokens so
far, `retract` / `in_place` hold them (retract counts a retraction); `/continue_generation` resumes them.
`/update_weights_from_disk` and `/update_weight_version` change the version as SGLang's scheduler does
(`record_weight_version_change`: a `WeightVersionEvent` per live request with tokens); `/update_weight_version`
aborts every request unless `abort_all_requests` is false. A finished answer's `weight_versions` spans and
`weight_version` come from SGLang's own `sglang.srt.utils.weight_versions`. `calls` records each control call.
"""
import asyncio
import os

from aiohttp import web

from support.fake_sglang import FakeSGLang, answer


class UpdatingSGLang(FakeSGLang):
    def __init__(self, tick_s: float = 0.01, version: str = "default", **kw):
        super().__init__({"/pause_generation": self.pause, "/continue_generation": self.resume,
                          "/flush_cache": self.flush, "/update_weights_from_disk": self.from_disk,
                          "/update_weight_version": self.publish}, **kw)
        self.tick_s, self.version = tick_s, version
        self.live: dict = {}          # rid -> {"tokens": [...], "events": [...], "retractions": int, "abort": bool}
        self.running = asyncio.Event()
        self.running.set()
        self.calls: list = []         # (path, body) of every control call
        self.generated = 0            # tokens made, every request together

    async def model_info(self, request):
        return web.json_response({"weight_version": self.version})

    async def generate(self, request):
        from sglang.srt.utils.weight_versions import add_weight_versions_to_meta_info, compute_weight_version_spans

        body = await request.json()
        n = body.get("sampling_params", {}).get("max_new_tokens", 1)
        req = {"tokens": [], "n": n, "events": [], "retractions": 0, "abort": False}
        self.live[id(req)] = req
        try:
            while len(req["tokens"]) < n and not req["abort"]:
                await self.running.wait()
                await asyncio.sleep(self.tick_s)
                if self.running.is_set() and not req["abort"]:
                    req["tokens"].append(3 + len(req["tokens"]) % 50)
                    self.generated += 1
        finally:
            self.live.pop(id(req), None)
        k = len(req["tokens"])
        finish = {"type": "abort", "message": "Abort before finishing"} if req["abort"] else \
            {"type": "length", "length": n}
        out = answer(req["tokens"], finish, prompt_tokens=len(body.get("input_ids") or []),
                     num_retractions=req["retractions"])
        add_weight_versions_to_meta_info(out["meta_info"], compute_weight_version_spans(req["events"], self.version, k),
                                         k)
        return web.json_response(out)

    async def midway(self, k: int = 3, timeout_s: float = 30.0) -> None:
        """Wait (from any thread) until some request in flight has at least `k` tokens made and `k` to go: a
        weight update then lands inside it, whatever the machine's speed."""
        end = asyncio.get_running_loop().time() + timeout_s
        while not any(k <= len(r["tokens"]) <= r["n"] - k for r in list(self.live.values())):
            assert asyncio.get_running_loop().time() < end, "no request in flight reached the middle"
            await asyncio.sleep(0.005)

    def _abort_all(self):
        for req in self.live.values():
            req["abort"] = True

    def _set_version(self, new):
        from sglang.srt.utils.weight_versions import WeightVersionEvent

        if new is None or new == self.version:
            return
        for req in self.live.values():
            if req["tokens"]:
                req["events"].append(WeightVersionEvent(old_version=self.version, num_output_tokens=len(req["tokens"])))
        self.version = new

    async def _body(self, request):
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path, body))
        return body

    async def pause(self, request):
        mode = (await self._body(request)).get("mode", "abort")
        if mode == "abort":
            self._abort_all()
        else:
            self.running.clear()
            if mode == "retract":
                for req in self.live.values():
                    req["retractions"] += 1
        return web.json_response({})

    async def resume(self, request):
        await self._body(request)
        self.running.set()
        return web.json_response({})

    async def flush(self, request):
        await self._body(request)
        return web.Response(status=200)

    async def from_disk(self, request):
        body = await self._body(request)
        if not os.path.isdir(body.get("model_path") or ""):
            return web.json_response({"success": False, "message": f"no checkpoint at {body.get('model_path')}"},
                                     status=400)
        self._set_version(body.get("weight_version"))
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def publish(self, request):
        body = await self._body(request)
        if body.get("abort_all_requests", True):
            self._abort_all()
        self._set_version(body.get("new_version"))
        return web.json_response({})
