"""Plugin mode's backend: a RolloutManager attached to the workers behind slime's router (the router is
used for discovery only), on one background event loop.

The request slime's own rollout sends is the one sent here: `sampling_from_args` builds the sampling
params as slime's `GenerateState` does, `WorkerDispatcher` adds slime's per-sample `sampling_seed`
(deterministic inference), asks for the continuation budget `max_new_tokens - response_length`, sends
nothing when that is 0 (the sample is TRUNCATED), and keeps every answer's SGLang `text` and
`meta_info` so the adapter can replay them through slime's `Sample.append_response_tokens`.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

from rollout.dispatch import Dispatcher

CONFIG_ENV = "SLIME_MOE_ROLLOUT_CONFIG"   # optional YAML (training_configs schema) for model facts


class Loop:
    """One asyncio loop in a daemon thread: slime calls the rollout function synchronously."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="slime-moe-rollout", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def run_async(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


def moe_layout(args):
    """MoE layout from the YAML named by $SLIME_MOE_ROLLOUT_CONFIG, else from Megatron's args."""
    from rollout.routed_experts import MoELayout
    path = os.environ.get(CONFIG_ENV) or getattr(args, "slime_moe_rollout_config", None)
    if path:
        from training_configs.schema import load_config
        m = load_config(path).model
        return MoELayout.from_first_k_dense(m.num_layers, m.first_k_dense_replace, m.num_experts, m.topk)
    freq = getattr(args, "moe_layer_freq", None)
    if freq is not None:
        return MoELayout.from_layer_freq(freq, args.num_experts, args.moe_router_topk, args.num_layers)
    return MoELayout.from_first_k_dense(args.num_layers, 0, args.num_experts, args.moe_router_topk)


def sampling_from_args(args) -> dict:
    """The sampling params slime's own rollout sends for a training sample (slime's GenerateState)."""
    sp = {"temperature": args.rollout_temperature, "top_p": args.rollout_top_p, "top_k": args.rollout_top_k,
          "max_new_tokens": args.rollout_max_response_len, "stop": getattr(args, "rollout_stop", None),
          "stop_token_ids": getattr(args, "rollout_stop_token_ids", None),
          "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
          "no_stop_trim": True, "spaces_between_special_tokens": False}
    if args.rollout_top_p != 1.0:
        sp["custom_params"] = {"return_top_p_token_ids": True}
    return sp


def group_seeds(args):
    """slime's per-index `sampling_seed` (rollout_seed + index in the group) under deterministic inference."""
    if not getattr(args, "sglang_enable_deterministic_inference", False):
        return None
    return [args.rollout_seed + i for i in range(int(args.n_samples_per_prompt))]


def router_url(args) -> str:
    """slime's router: --sglang-router-ip/port, or (slime 0.3.x) args.sglang_model_routers {name: (ip, port)}."""
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not (ip and port):
        routers = getattr(args, "sglang_model_routers", None) or {}
        if not routers:
            raise ValueError("no slime router address: neither --sglang-router-ip/port nor args.sglang_model_routers")
        ip, port = routers.get("default") or next(iter(routers.values()))
    return f"http://{ip}:{port}"


async def attach_workers(args, layout):
    """A RolloutManager that sends to the workers registered with slime's router (one slot each).

    The router is asked only who they are (`GET /workers`, as slime's own abort does): every PyPI
    sglang-router drops `return_routed_experts` from /generate (scripts/probe_router_fields.py), and the
    manager balances over the workers itself. slime pauses, updates and continues each engine directly
    (`SGLangEngine.pause_generation` etc.), never through the router, so nothing slime expects is skipped.
    """
    from rollout.manager import RolloutManager
    from training_configs.schema import HealthConfig, ReadinessBudgets

    decode = None
    if getattr(args, "use_rollout_routing_replay", False):
        from rollout.routed_experts.validate import try_decode_compact

        def decode(payload, num_tokens, start_len):
            return try_decode_compact(payload, layout, num_tokens, start_len)

    mgr = RolloutManager([], None, budgets=ReadinessBudgets(), health=HealthConfig(),
                         sampling=sampling_from_args(args), n_samples=int(args.n_samples_per_prompt),
                         concurrency=int(getattr(args, "sglang_server_concurrency", 512)), decode_routed=decode,
                         partial_rollout=bool(getattr(args, "partial_rollout", True)))
    await mgr.attach([], dispatcher_cls=WorkerDispatcher)
    d = mgr.dispatcher
    d.router, d.api_key, d.seeds = router_url(args), getattr(args, "sglang_api_key", None), group_seeds(args)
    d.version_of, d.on_error = mgr._reported_version, d.relist
    try:
        await d.sync()
    except BaseException:
        await mgr.session.close()
        raise
    return mgr


class Endpoint:
    def __init__(self, name, url, api_key=None):
        self.name, self.url, self.api_key = name, url, api_key


async def list_workers(session, router: str) -> list:
    """slime's router's `GET /workers` -> its worker dicts (sglang-router 0.3.x: {"workers": [{"url",
    "worker_type", "is_healthy", ...}], ...}; older builds: a plain list)."""
    import aiohttp
    try:
        async with session.get(router + "/workers", timeout=aiohttp.ClientTimeout(total=10)) as r:
            body = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        raise RuntimeError(f"slime's router {router} did not list its workers: {type(e).__name__}: {e}") from None
    items = body.get("workers", []) if isinstance(body, dict) else body
    return [w if isinstance(w, dict) else {"url": w} for w in items or []]


class WorkerDispatcher(Dispatcher):
    """The manager's dispatcher speaking slime's request rules straight to the workers behind slime's router."""

    seeds = None
    router = ""
    api_key = None
    version_of = None          # async (endpoint) -> weight version it reports, or None
    listed: tuple = ()          # every worker URL the router listed last (abort goes to all of them)
    synced_at = 0.0
    _sync = None

    empty_wait_s = 60.0   # the router registers workers in the background (POST /workers answers 202)

    async def sync(self, max_age_s: float = 0.0, wait_s: float | None = None) -> None:
        """Re-list the router's workers: admit new ones, remove gone ones (their requests are re-sent).
        An empty list is re-read for up to `wait_s` (default `empty_wait_s`) before samples fail.
        With prefill/decode workers only (PD disaggregation) the router stays the one slot: only it pairs them."""
        if time.monotonic() - self.synced_at < max_age_s:
            return
        if self._sync is None or self._sync.done():
            wait = self.empty_wait_s if wait_s is None else wait_s
            self._sync = asyncio.ensure_future(self._relist(time.monotonic() + wait))
        await asyncio.shield(self._sync)

    async def relist(self, engine=None) -> None:
        """After a connection error: slime may have removed (health monitor) or replaced the worker."""
        try:
            await self.sync(max_age_s=1.0, wait_s=0.0)
        except RuntimeError:
            pass

    async def _relist(self, until: float) -> None:
        while True:
            workers = await list_workers(self.session, self.router)
            if workers or time.monotonic() >= until:
                break
            await asyncio.sleep(0.5)
        self.listed = tuple(w["url"] for w in workers if w.get("url"))
        want = [w["url"] for w in workers if w.get("url") and w.get("worker_type", "regular") == "regular"
                and w.get("is_healthy", True)]
        if not want and self.listed:
            want = [self.router]
        for name, slot in list(self.slots.items()):
            if name not in want:
                await self.remove(slot.engine)
        for url in want:
            if url not in self.slots:
                ep = Endpoint(url, url, self.api_key)
                await self.admit(ep, await self.version_of(ep) if self.version_of else None)
        self.synced_at = time.monotonic()
        async with self._cond:
            self.closed_reason = None if want else f"slime's router {self.router} lists no workers"
        self._wake_all()

    def budget_left(self, sample) -> int:
        return int(sample.max_new_tokens or self.sampling["max_new_tokens"]) - len(sample.response_ids)

    def payload(self, sample, rid: str) -> dict:
        body = super().payload(sample, rid)
        if self.seeds:
            body["sampling_params"]["sampling_seed"] = self.seeds[sample.index % len(self.seeds)]
        return body

    async def run(self, sample):
        if self.budget_left(sample) <= 0:   # slime: nothing left -> TRUNCATED, no request
            sample.status = "truncated"
            return sample
        return await super().run(sample)

    def _apply(self, sample, out: dict) -> None:
        before = len(sample.response_ids)
        super()._apply(sample, out)
        meta = {k: v for k, v in out.get("meta_info", {}).items() if k != "routed_experts"}
        if not hasattr(sample, "outputs"):
            sample.outputs = []
        sample.outputs.append((len(sample.response_ids) - before, out.get("text", ""), meta))

    async def abort(self, rids_prefix=None):
        """Abort stragglers on every worker the router listed (as slime's abort does; a router has no
        /abort_request)."""
        import aiohttp

        from rollout.engines.readiness import auth_headers

        async def one(url):
            try:
                async with self.session.post(url + "/abort_request", json={"abort_all": True},
                                             headers=auth_headers(self.api_key),
                                             timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
        await asyncio.gather(*(one(u) for u in self.listed or [s.engine.url for s in self.slots.values()]))
