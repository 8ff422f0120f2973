"""slime plug-in points backed by the rollout manager.

    --rollout-function-path rollout.slime_adapter.generate_rollout
    --custom-generate-function-path rollout.slime_adapter.generate

`generate_rollout(args, rollout_id, data_source, evaluation=False)` takes `rollout_batch_size` prompt
groups from slime's data source, runs them through the manager (GRPO groups of
`n_samples_per_prompt`, least-outstanding dispatch, stragglers aborted and carried to the next step),
and returns slime's `RolloutFnTrainOutput` of `Sample` groups with `tokens`, `response_length`,
`rollout_log_probs`, `loss_mask`, `status`, `reward` and, with `--use-rollout-routing-replay`,
`rollout_routed_experts` in slime's shape `[len(tokens)-1, num_layers, topk]` int32.
`generate(args, sample, sampling_params)` generates one sample through the same manager.

The backend is any object with the manager's interface (`RolloutManager` is the real one):
    n_samples: int                      samples per prompt group
    async rollout(prompts, sink, batch_size) -> result   groups go to `await sink.put(group)` as they
                                        finish; a group has `.group_id` and `.samples`, each sample
                                        `.prompt_ids .response_ids .logprobs .routed_experts (compact)
                                        .status .error .weight_versions`
    dispatcher.run(sample) (async)      one manager `rollout.dispatch.Sample` (for `generate`)
By default it is a `RolloutManager` attached to slime's router (`--sglang-router-ip/port`): the engines
are slime's (plugin mode) or ours attached through `--rollout-external-engine-addrs` (managed mode);
both are registered with that router. `set_backend()` injects another one (tests, an in-process
manager). The manager's asyncio objects live on one background event loop owned by this module.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import os
import threading

from rollout.dispatch import Dispatcher
from rollout.slime_types import RolloutFnTrainOutput, Sample

CONFIG_ENV = "SLIME_MOE_ROLLOUT_CONFIG"   # optional YAML (training_configs schema) for model facts
_STATE: dict = {}
_LOCK = threading.Lock()


# ------------------------------------------------------------------ background loop
class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="slime-moe-rollout", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def run_async(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


def _loop() -> _Loop:
    with _LOCK:
        if "loop" not in _STATE:
            _STATE["loop"] = _Loop()
        return _STATE["loop"]


# ------------------------------------------------------------------ wiring
def set_backend(backend, tokenizer=None, layout=None) -> None:
    """Use `backend` (manager-like, see module doc) for every later call; `layout` is a
    `rollout.routed_experts.MoELayout` (needed only with routed experts)."""
    _STATE.update(backend=backend, tokenizer=tokenizer, layout=layout)


def reset() -> None:
    """Close an attached backend's HTTP session and forget the backend (the next call attaches again)."""
    backend = _STATE.get("backend")
    session = getattr(backend, "session", None)
    if session is not None and "loop" in _STATE and not session.closed:
        _STATE["loop"].run(session.close())
    for key in ("backend", "tokenizer", "layout", "pending"):
        _STATE.pop(key, None)


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
    return {"temperature": getattr(args, "rollout_temperature", 1.0), "top_p": getattr(args, "rollout_top_p", 1.0),
            "top_k": getattr(args, "rollout_top_k", -1),
            "max_new_tokens": getattr(args, "rollout_max_response_len", 1024)}


def router_url(args) -> str:
    """slime's router: --sglang-router-ip/port, or (slime 0.3.x) args.sglang_model_routers {name: (ip, port)}."""
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not (ip and port):
        routers = getattr(args, "sglang_model_routers", None) or {}
        if not routers:
            raise ValueError("no slime router address: neither --sglang-router-ip/port nor args.sglang_model_routers")
        ip, port = routers.get("default") or next(iter(routers.values()))
    return f"http://{ip}:{port}"


async def _attach_router(args, layout):
    """A RolloutManager with one admitted 'engine': slime's router (which balances over its workers)."""
    from rollout.manager import RolloutManager
    from training_configs.schema import HealthConfig, ReadinessBudgets

    url = router_url(args)
    engines = max(1, int(getattr(args, "rollout_num_gpus", 1) or 1)
                  // max(1, int(getattr(args, "rollout_num_gpus_per_engine", 1) or 1)))
    capacity = int(getattr(args, "sglang_server_concurrency", 512)) * engines
    decode = None
    if getattr(args, "use_rollout_routing_replay", False):
        from rollout.routed_experts.validate import try_decode_compact

        def decode(payload, num_tokens, start_len):
            return try_decode_compact(payload, layout, num_tokens, start_len)

    mgr = RolloutManager([], None, budgets=ReadinessBudgets(), health=HealthConfig(),
                         sampling=sampling_from_args(args), n_samples=int(args.n_samples_per_prompt),
                         concurrency=capacity, decode_routed=decode,
                         partial_rollout=bool(getattr(args, "partial_rollout", True)))
    # start() would launch engines; attach() only opens the session and admits the router.
    return await mgr.attach([_Endpoint("slime-router", url, getattr(args, "sglang_api_key", None))],
                            dispatcher_cls=_RouterDispatcher)


class _Endpoint:
    def __init__(self, name, url, api_key=None):
        self.name, self.url, self.api_key = name, url, api_key


class _RouterDispatcher(Dispatcher):
    """Aborts stragglers on every worker behind the router (the router itself has no /abort_request)."""

    async def abort(self, rids_prefix=None):
        import aiohttp
        for slot in list(self.slots.values()):
            try:
                async with self.session.get(slot.engine.url + "/workers",
                                            timeout=aiohttp.ClientTimeout(total=10)) as r:
                    body = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                continue
            items = body.get("workers", body) if isinstance(body, dict) else body
            urls = [w.get("url") if isinstance(w, dict) else w for w in (items or [])]
            for u in filter(None, urls):
                try:
                    async with self.session.post(u + "/abort_request", json={"abort_all": True},
                                                 timeout=aiohttp.ClientTimeout(total=10)) as r:
                        await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass


def _ensure(args):
    if "backend" in _STATE:
        return _STATE["backend"], _STATE.get("tokenizer"), _STATE.get("layout")
    layout = moe_layout(args) if getattr(args, "use_rollout_routing_replay", False) else None
    backend = _loop().run(_attach_router(args, layout))
    tokenizer = _STATE["tokenizer"] if "tokenizer" in _STATE else _load_tokenizer(args)
    set_backend(backend, tokenizer, layout)
    return backend, tokenizer, layout


def _load_tokenizer(args):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)


# ------------------------------------------------------------------ conversion
_STATUS = {"completed": "COMPLETED", "truncated": "TRUNCATED", "aborted": "ABORTED", "failed": "FAILED",
           "pending": "PENDING"}


def _prompt_ids(sample, tokenizer) -> list:
    if sample.tokens:
        return list(sample.tokens)
    if tokenizer is None:
        raise ValueError("sample has no tokens and no tokenizer is set")
    prompt = sample.prompt
    if isinstance(prompt, list):  # chat messages
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  **(sample.apply_chat_template_kwargs or {})))
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def fill_sample(dst: Sample, src, tokenizer=None, layout=None, prior_routed=None) -> Sample:
    """Copy one manager sample's result into slime's `Sample`, appending to any earlier response
    (the fields slime's `append_response_tokens` maintains, set directly)."""
    if not dst.tokens:
        dst.tokens = list(src.prompt_ids)
    done = len(dst.tokens) - len(src.prompt_ids)          # response tokens slime already holds
    new = list(src.response_ids)[done:]
    lps = [float(x) for x in list(src.logprobs)[done:]]
    dst.tokens = list(dst.tokens) + new
    dst.response_length = (dst.response_length or 0) + len(new)
    dst.response = (dst.response or "") + (tokenizer.decode(new) if (tokenizer is not None and new) else "")
    dst.rollout_log_probs = list(dst.rollout_log_probs or []) + lps
    dst.loss_mask = list(dst.loss_mask or []) + [1] * len(new)
    dst.status = getattr(Sample.Status, _STATUS.get(src.status, "COMPLETED"))
    dst.weight_versions = list(dst.weight_versions or []) + list(src.weight_versions)
    if src.error:
        dst.metadata = dict(dst.metadata or {}, slime_moe_rollout_error=src.error)
    if src.routed_experts is not None and layout is not None:
        from rollout.routed_experts import to_slime_shape
        full = to_slime_shape(src.routed_experts, layout)
        missing = len(dst.tokens) - 1 - full.shape[0]
        if missing > 0 and prior_routed is not None:  # continuation: earlier rows come from slime's sample
            import torch
            full = torch.cat([torch.as_tensor(prior_routed)[:missing], full], dim=0)
        dst.rollout_routed_experts = full
    return dst


# ------------------------------------------------------------------ rewards
def _reward_fn(args):
    path = getattr(args, "custom_rm_path", None)
    if path:
        mod, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(mod), attr)
    try:
        from slime.rollout.rm_hub import async_rm  # type: ignore
        return async_rm
    except ImportError:
        return None


async def _rewards(args, samples) -> None:
    fn = _reward_fn(args)
    if fn is None:
        return
    if getattr(args, "group_rm", False):
        values = fn(args, samples)
        values = await values if inspect.isawaitable(values) else values
        for s, v in zip(samples, values):
            s.reward = v
        return
    for s in samples:
        v = fn(args, s)
        s.reward = await v if inspect.isawaitable(v) else v


# ------------------------------------------------------------------ slime entry points
class _Sink:
    """Receives finished manager groups as they finish and turns them into slime groups."""

    def __init__(self, args, pending: dict, tokenizer, layout):
        self.args, self.pending, self.tokenizer, self.layout = args, pending, tokenizer, layout
        self.groups: list = []
        self.seen: set = set()

    async def put(self, group) -> bool:
        if group.group_id in self.seen:
            return False
        self.seen.add(group.group_id)
        slime_group, _ = self.pending.pop(group.group_id)
        for dst, src in zip(slime_group, group.samples):
            fill_sample(dst, src, self.tokenizer, self.layout)
        await _rewards(self.args, slime_group)
        self.groups.append(slime_group)
        return True


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime `--rollout-function-path` entry point."""
    if evaluation:
        raise NotImplementedError("rollout.slime_adapter serves training rollouts; keep slime's default "
                                  "--eval-function-path (slime.rollout.sglang_rollout.generate_rollout)")
    backend, tokenizer, layout = _ensure(args)
    n = int(args.n_samples_per_prompt)
    if getattr(backend, "n_samples", n) != n:
        raise ValueError(f"backend generates {backend.n_samples} samples per prompt, slime asks for {n}")
    pending: dict = _STATE.setdefault("pending", {})   # manager group id -> slime samples (carried too)
    carried = len(getattr(backend, "carry", []) or [])
    want = int(args.rollout_batch_size)
    # like slime's --over-sampling-batch-size: start more groups than needed, abort the slowest
    take = max(want, int(getattr(args, "over_sampling_batch_size", None) or want))
    new_groups = data_source.get_samples(take - carried) if take > carried else []
    prompts = []
    for g in new_groups:
        for s in g:
            s.rollout_id = rollout_id
        prompts.append(_prompt_ids(g[0], tokenizer))
    loop = _loop()
    sink = _Sink(args, pending, tokenizer, layout)
    made: list = []   # manager group ids, in the order the manager creates the new groups

    async def run():
        orig = backend.new_group

        def new_group(prompt_ids):   # the manager creates every new group before dispatching any
            group = orig(prompt_ids)
            made.append(group.group_id)
            return group

        backend.new_group = new_group
        reg = _Register(sink, made, list(zip(new_groups, prompts)), pending)
        try:
            result = await backend.rollout(prompts, reg, batch_size=want)
        finally:
            backend.new_group = orig
        reg.bind()   # groups that are all carried to the next step were never put
        _rebind_carried(backend, pending)
        return result

    result = loop.run(run())
    metrics = {"rollout/groups": len(sink.groups), "rollout/carried": getattr(result, "carried", 0),
               "rollout/resent": getattr(result, "resent", 0),
               "rollout/first_group_s": getattr(result, "first_group_s", None),
               "rollout/wall_s": getattr(result, "wall_s", None)}
    return RolloutFnTrainOutput(samples=sink.groups, metrics=metrics)


def _rebind_carried(backend, pending: dict) -> None:
    """Without partial rollout the manager re-creates unfinished groups under new ids (same prompt):
    move their slime samples to the new ids so the next step can still return them."""
    stale = {gid: v for gid, v in pending.items() if gid not in {g.group_id for g in getattr(backend, "carry", [])}}
    for g in getattr(backend, "carry", []) or []:
        if g.group_id in pending:
            continue
        for gid, (slime_group, prompt) in list(stale.items()):
            if prompt == tuple(g.prompt_ids):
                pending[g.group_id] = pending.pop(gid)
                del stale[gid]
                break


class _Register:
    """Sink wrapper: binds manager group ids (known only once the manager made the groups) to slime groups."""

    def __init__(self, sink, made, todo, pending):
        self.sink, self.made, self.todo, self.pending = sink, made, todo, pending

    def bind(self) -> None:
        while self.made and self.todo:
            slime_group, prompt = self.todo.pop(0)
            self.pending[self.made.pop(0)] = (slime_group, tuple(prompt))

    async def put(self, group) -> bool:
        self.bind()
        return await self.sink.put(group)


_SAMPLE_IDS = itertools.count()


async def generate(args, sample, sampling_params, evaluation=False):
    """slime `--custom-generate-function-path` entry point: one sample through the manager."""
    from rollout.dispatch import Sample as MSample
    backend, tokenizer, layout = _ensure(args)
    prompt_len = len(sample.tokens) - (sample.response_length or 0) if sample.tokens else 0
    ids = _prompt_ids(sample, tokenizer)
    prompt_ids, response_ids = (ids[:prompt_len], ids[prompt_len:]) if prompt_len else (ids, [])
    k = next(_SAMPLE_IDS)
    ms = MSample(f"slime{k}/0", f"slime{k}", 0, prompt_ids, response_ids=list(response_ids),
                 logprobs=[0.0] * len(response_ids))
    params = dict(sampling_params)
    params["max_new_tokens"] = int(params.get("max_new_tokens", 1024)) + len(response_ids)  # dispatcher subtracts

    async def run():
        disp = _with_sampling(backend.dispatcher, params)
        return await disp.run(ms)

    done = await _loop().run_async(run())
    prior = sample.rollout_routed_experts
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    return fill_sample(sample, done, tokenizer, layout, prior_routed=prior)


def _with_sampling(dispatcher, params: dict):
    """The dispatcher with other sampling params: a shallow copy shares its engines, slots and lock."""
    import copy
    d = copy.copy(dispatcher)
    d.sampling = {k: v for k, v in params.items() if v is not None}
    return d
