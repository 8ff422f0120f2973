"""Plugin mode's backend: a RolloutManager attached to the workers behind slime's router (the router is
used for discovery only), on one background event loop.

The request slime's own rollout sends is the one sent here: `sampling_from_args` builds the sampling
params as slime's `GenerateState` does, `group_seeds` gives slime's per-sample `sampling_seed`
(deterministic inference); the manager asks for the continuation budget `max_new_tokens - response_length`,
sends nothing when that is 0 (the sample is TRUNCATED), and keeps every answer's SGLang `text` and
`meta_info` (`keep_answers`) so the adapter can replay them through slime's `Sample.append_response_tokens`.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading

from rollout.engines.readiness import ReadinessError, fix_refusal
from rollout.errors import ApiKeyRejected, EngineError
from rollout.types import Endpoint

__all__ = ["Endpoint", "Loop", "RouterWorkers", "attach_workers", "moe_layout", "router_flag_warning",
           "sampling_from_args"]

CONFIG_ENV = "SLIME_MOE_ROLLOUT_CONFIG"   # optional YAML (training_configs schema) for model facts
ALLOW_UNFIXED_ENV = "SLIME_MOE_ROLLOUT_ALLOW_UNFIXED"   # 1: attach to workers whose needed fixes are not good
EMPTY_WAIT_S = 60.0   # the router registers workers in the background (POST /workers answers 202)


class Loop:
    """One asyncio loop in a daemon thread: slime calls the rollout function synchronously. `loop`: an
    existing loop already running in its own thread (slime's `async_utils` loop) instead of a new one."""

    def __init__(self, loop=None):
        self.loop = loop or asyncio.new_event_loop()
        if loop is None:
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
        return MoELayout.from_model(load_config(path).model)
    freq = getattr(args, "moe_layer_freq", None)
    if freq is not None:
        return MoELayout.from_layer_freq(freq, args.num_experts, args.moe_router_topk, args.num_layers)
    return MoELayout.from_first_k_dense(args.num_layers, 0, args.num_experts, args.moe_router_topk)


def allow_unfixed(args) -> tuple:
    """(admit workers without their fixes?, the switch that says so): $SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1,
    else `rollout.allow_unfixed` of the YAML named by $SLIME_MOE_ROLLOUT_CONFIG."""
    if os.environ.get(ALLOW_UNFIXED_ENV) == "1":
        return True, f"{ALLOW_UNFIXED_ENV}=1"
    path = os.environ.get(CONFIG_ENV) or getattr(args, "slime_moe_rollout_config", None)
    if path:
        from training_configs.schema import load_config
        return load_config(path).rollout.allow_unfixed, f"rollout.allow_unfixed: true in {path}"
    return False, f"{ALLOW_UNFIXED_ENV}=1"


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


ROUTER_DEFAULTS = {"router_policy": ("cache_aware", None),   # sglang-router's RouterArgs default
                   "sglang_router_request_timeout_secs": (14400, None)}   # slime's default


def router_flag_warning(args):
    """One line naming slime's router flags set away from their defaults: plugin mode sends to the workers
    itself (the router only lists them), so they do not apply. None when there are none."""
    names = [n for n, defaults in ROUTER_DEFAULTS.items() if getattr(args, n, None) not in defaults]
    if not names:
        return None
    flags = ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names)
    return (f"slime-moe-rollout: warning: {flags} do(es) not apply in plugin mode (requests go to the workers "
            "directly, placed per group; slime's router only lists them)")


async def attach_workers(args):
    """A RolloutManager that sends to the workers registered with slime's router (one slot each).

    The router is asked only who they are (`GET /workers`, as slime's own abort does): every PyPI
    sglang-router drops `return_routed_experts` from /generate (scripts/probe_router_fields.py), and the
    manager balances over the workers itself. slime pauses, updates and continues each engine directly
    (`SGLangEngine.pause_generation` etc.), never through the router, so nothing slime expects is skipped.
    """
    from rollout.manager import RolloutManager, RolloutOptions, engine_source

    line = router_flag_warning(args)
    if line:
        print(line, file=sys.stderr, flush=True)
    layout = moe_layout(args) if getattr(args, "use_rollout_routing_replay", False) else None
    workers = RouterWorkers(router_url(args), getattr(args, "sglang_api_key", None), allow_unfixed(args))
    options = RolloutOptions(sampling_from_args(args), int(args.n_samples_per_prompt),
                             int(getattr(args, "sglang_server_concurrency", 512)), layout=layout,
                             seeds=group_seeds(args), keep_answers=True,
                             partial_rollout=bool(getattr(args, "partial_rollout", True)))
    return await RolloutManager(engine_source(discover=workers, empty_wait_s=EMPTY_WAIT_S), options).start()


class RouterWorkers:
    """The manager's `discover`: who slime's router lists now. Regular healthy workers are sent to; with
    prefill/decode workers only (PD disaggregation) the router stays the one endpoint (only it pairs them).
    Stragglers are aborted on every listed worker, as slime's abort does (a router has no /abort_request).
    Each worker (sent to, or each prefill/decode worker behind the router) is admitted once, when first
    listed, by the fix report in its `/server_info` (`readiness.fix_refusal`, as the main job's engines);
    one whose needed fixes are not good raises `ReadinessError` naming it and the fix, unless `unfixed`
    allows it. A worker whose `/server_info` does not answer is not admitted (a regular one is not sent to)
    until a later listing reads it."""

    def __init__(self, router: str, api_key=None, unfixed: tuple = (False, f"{ALLOW_UNFIXED_ENV}=1")):
        self.router, self.api_key, self.unfixed = router, api_key, unfixed
        self.admitted: set = set()

    def __str__(self) -> str:
        return f"slime's router {self.router}"

    async def __call__(self, client) -> tuple:
        """(endpoints to send to, endpoints to abort on) as the router lists them now; an unreachable router
        raises `EngineUnreachable` naming it."""
        send, abort = self.split(await client.list_workers(Endpoint(str(self), self.router, None)))
        workers = abort if [e.url for e in send] == [self.router] else send   # PD: the workers behind it
        self.admitted &= {e.name for e in workers}   # a worker that left is checked again when it returns
        new = [e for e in workers if e.name not in self.admitted]
        unread = set()
        for e, info in zip(new, await asyncio.gather(*(self._server_info(client, e) for e in new))):
            if info is None:
                unread.add(e.name)
                continue
            reason = fix_refusal(f"worker {e.name}", info, *self.unfixed)
            if reason is not None:
                raise ReadinessError(e.name, "fix report", 0, reason, [])
            self.admitted.add(e.name)
        return [e for e in send if e.name not in unread], abort

    @staticmethod
    async def _server_info(client, endpoint):
        try:
            return await client.server_info(endpoint)
        except ApiKeyRejected:
            raise
        except EngineError:
            return None

    def split(self, workers: list) -> tuple:
        """The router's worker dicts -> (endpoints to send to, endpoints to abort on)."""
        listed = [w["url"] for w in workers if w.get("url")]
        send = [w["url"] for w in workers if w.get("url") and w.get("worker_type", "regular") == "regular"
                and w.get("is_healthy", True)]
        if not send and listed:
            send = [self.router]
        return ([Endpoint(u, u, self.api_key) for u in send], [Endpoint(u, u, self.api_key) for u in listed])
