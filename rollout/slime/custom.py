"""Custom generate functions in plugin mode: slime's `--custom-generate-function-path` (and a sample's own
`generate_function_path`) called for every training sample, its requests answered by the manager.

slime's example functions build the URL themselves (`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`)
and post with `slime.utils.http_utils.post`, imported by name at their import (`from ... import post`), so
wrapping `post` would miss them. Instead `Front` is a loopback HTTP server speaking SGLang's `/generate`
(input_ids in; `text`, `output_ids`, `meta_info` with `output_token_logprobs`, `finish_reason`, base64 int32
`routed_experts` of every token of the sequence out), and `args.sglang_router_ip/port` point at it while the
functions run. A request carries no group or sample id, so the front keys it by the longest known token
prefix: a fresh sample's first turn by its group's prompt, a later turn by the tokens its sample's previous
turn ended with. Each turn is one `RolloutManager.generate` call of a manager sample in the slime group's
manager group, carrying the engine and DP rank of the sample's previous turn: group placement
(`rollout/placement.py`) seats the group's samples together and sends every later turn back to that rank,
so each turn's prefix is in its cache; lost engines and re-sends are the dispatcher's (exactly once per
turn). The user's function merges the turns itself, as under slime (`Sample.append_response_tokens`).

The fully-async pool (`Step(..., background=True)`) runs the functions between slime's calls: they get a copy
of slime's args, taken when the pool starts, pointing at the front (slime's own keep its router, for its eval
meanwhile), a turn an engine aborted (a weight update's pause) is continued from its tokens, as the manager
continues its own samples, and `versions` says which weight version sampled which tokens of each returned
sample, from every turn's answers.
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import math
import uuid
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from rollout.routed_experts import encode_sglang, expand
from rollout.slime import attach
from rollout.slime.convert import flat, prompt_ids, version_spans
from rollout.slime.sink import Sink, failure_line
from rollout.slime.state import load, loop
from rollout.types import Sample as ManagerSample
from rollout.types import SampleStatus

__all__ = ["CustomSink", "Front", "Step", "active", "custom_path", "run_group", "versions"]
SGLANG_MAX_NEW_TOKENS = 128   # SGLang's SamplingParams default, for a request that names none
_FINISH = {SampleStatus.TRUNCATED: "length", SampleStatus.ABORTED: "abort", SampleStatus.PENDING: "abort",
           SampleStatus.COMPLETED: "stop"}   # PENDING: not sent, the batch filled first


@dataclass
class _Track:
    """What the front knows of one slime sample: the tokens its last turn ended with, where it ran."""

    group_id: str
    index: int
    known: list            # tokens: the request's and its answer's
    text: str = ""         # the same as text, for functions that send text (slime's search-r1 example)
    engines: list = field(default_factory=list)
    dp_rank: Optional[int] = None
    turns: int = 0
    busy: bool = False     # a turn of it is in flight (another request with its prefix is another sample's)
    spans: list = field(default_factory=list)      # SGLang's version spans of its answers, positions in `known`
    versions: list = field(default_factory=list)   # the version each answer finished under (slime's rule)
    spanned: bool = True   # every answer named its tokens' versions (SGLang 0.5.19+), not only the last one


class Front:
    """SGLang's `/generate` on a loopback port, answered by `backend.generate` with group placement."""

    def __init__(self, backend, tokenizer=None):
        self.backend, self.tokenizer = backend, tokenizer
        self.roots: dict = {}      # group id -> [prompt ids, prompt text, next sample index]
        self.tracks: list = []
        self.requests = 0
        self.failed: dict = {}     # group id -> asyncio.Event, set at its first FAILED turn
        self.failures: dict = {}   # group id -> the manager sample of that turn
        self.resume: set = set()   # group ids whose turns an engine aborted are continued (the pool's)
        self.runner = self.port = None

    async def start(self) -> "Front":
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self._generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def open_group(self, group_id: str, prompt_ids: list, prompt_text=None, resume: bool = False) -> None:
        self.roots[group_id] = [list(prompt_ids), prompt_text if isinstance(prompt_text, str) else None, 0]
        if resume:
            self.resume.add(group_id)

    def watch(self, group_id: str) -> asyncio.Event:
        """Set when a turn of the group comes back FAILED (`failures[group_id]` is its manager sample)."""
        return self.failed.setdefault(group_id, asyncio.Event())

    def close_group(self, group_id: str) -> list:
        """Forget the group; returns its tracks (one per sample that sent a turn)."""
        self.roots.pop(group_id, None)
        self.failed.pop(group_id, None)
        self.resume.discard(group_id)
        mine = [t for t in self.tracks if t.group_id == group_id]
        self.tracks = [t for t in self.tracks if t.group_id != group_id]
        return mine

    def _track(self, key, by_text: bool) -> Optional[_Track]:
        """The sample a request continues (the longest known prefix of its tokens, or of its text), or a new
        one of the group whose prompt it starts with."""
        def starts(prefix):
            return prefix is not None and len(prefix) <= len(key) and key[:len(prefix)] == prefix
        best = max((t for t in self.tracks if starts(t.text if by_text else t.known)),
                   key=lambda t: (len(t.text if by_text else t.known), not t.busy), default=None)
        root = max(((g, r) for g, r in self.roots.items() if starts(r[1] if by_text else r[0])),
                   key=lambda gr: len(gr[1][1] if by_text else gr[1][0]), default=None)
        if best is not None and (root is None or len(best.text if by_text else best.known)
                                 > len(root[1][1] if by_text else root[1][0])):
            return best
        if root is None:
            return None
        gid, r = root
        t = _Track(gid, r[2], [])
        r[2] += 1
        self.tracks.append(t)
        return t

    async def _generate(self, request):
        body = await request.json()
        ids, text = body.get("input_ids"), body.get("text")
        if body.get("image_data") or not (isinstance(ids, list) and ids or isinstance(text, str) and text):
            return web.Response(status=400, text="plugin mode's front takes one request of input_ids or text "
                                                  "(no batches, no image_data)")
        if ids is None:
            if self.tokenizer is None:
                return web.Response(status=400, text="a text request needs slime's tokenizer (--hf-checkpoint)")
            ids = list(self.tokenizer.encode(text))   # as SGLang's tokenizer manager encodes a text prompt
        ids = [int(i) for i in ids]
        by_text = "input_ids" not in body
        track = self._track(text if by_text else ids, by_text)
        if track is None:
            return web.Response(status=400, text="the request starts with no prompt of this rollout step")
        sp = dict(body.get("sampling_params") or {})
        budget = sp.pop("max_new_tokens", SGLANG_MAX_NEW_TOKENS)
        if not isinstance(budget, int):
            return web.Response(status=400, text=f"plugin mode's front needs an int max_new_tokens, got {budget!r}")
        ms = ManagerSample(f"{track.group_id}/{track.index}", track.group_id, track.index, list(ids),
                           max_new_tokens=budget, engines=list(track.engines), dp_rank=track.dp_rank)
        if budget <= 0:
            ms.status = SampleStatus.TRUNCATED
        else:
            track.busy = True
            try:
                ms = await self.backend.generate(ms, sp)
                while ms.status is SampleStatus.ABORTED and track.group_id in self.resume:   # as the manager's loop
                    ms.resumes += 1
                    ms = await self.backend.generate(ms, sp)
            finally:
                track.busy = False
        self.requests += 1
        track.turns += 1
        track.engines, track.dp_rank = list(ms.engines), ms.dp_rank
        track.known = list(ids) + list(ms.response_ids)
        if ms.status is SampleStatus.FAILED:
            if track.group_id in self.failed:
                self.failures.setdefault(track.group_id, ms)
                self.failed[track.group_id].set()
            return web.Response(status=500, text=f"sample {ms.sample_id}: {ms.error}")
        answer = self._answer(ms, body)
        track.text = (text or "") + answer["text"]
        track.spans += [dict(s, start=s["start"] + len(ids), end=s["end"] + len(ids)) for s in version_spans(ms)]
        track.versions += [str(m["weight_version"]) for _, _, m in ms.outputs if m.get("weight_version") is not None]
        track.spanned = track.spanned and all(m.get("weight_versions") for _, _, m in ms.outputs)
        return web.json_response(answer)

    def _answer(self, ms: ManagerSample, body: dict) -> dict:
        """SGLang's answer to `body` from the turn's manager sample (its answers merged, if it was resumed)."""
        text = "".join(t for _, t, _ in ms.outputs)
        meta = dict(ms.outputs[-1][2]) if ms.outputs else {}
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(ms.logprobs, ms.response_ids)]
        meta.pop("routed_experts_start_len", None)
        if not meta.get("finish_reason"):   # no answer kept (no budget, or aborted while queued)
            meta["finish_reason"] = {"type": _FINISH.get(ms.status, "stop")}
        meta.setdefault("prompt_tokens", len(ms.prompt_ids))
        meta["completion_tokens"] = len(ms.response_ids)
        layout = self.backend.layout
        if body.get("return_routed_experts") and ms.routed_experts is not None and layout is not None:
            start = int(body.get("routed_experts_start_len") or 0)   # SGLang's wire: rows from start_len on
            meta["routed_experts"] = encode_sglang(expand(ms.routed_experts, layout)[start:])
            meta["routed_experts_start_len"] = start
        return {"text": text, "output_ids": list(ms.response_ids), "meta_info": meta}


def custom_path(args, sample) -> Optional[str]:
    """slime's rule: the sample's own `generate_function_path`, else `--custom-generate-function-path`."""
    return getattr(sample, "generate_function_path", None) or getattr(args, "custom_generate_function_path", None)


def active(args) -> bool:
    """A custom generate function of the user's is set (`rollout.slime.generate` is plugin mode's own path)."""
    return getattr(args, "custom_generate_function_path", None) not in (None, "rollout.slime.generate")


async def _call(args, fn, sample, sampling_params):
    if args_mask_offpolicy(args) and sample.response_length > 0:   # slime's generate_and_rm, before the call
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (sample.Status.COMPLETED, sample.Status.TRUNCATED):   # slime: already finished
        return sample
    if "evaluation" in inspect.signature(fn).parameters:
        return await fn(args, sample, sampling_params, evaluation=False)
    return await fn(args, sample, sampling_params)


def args_mask_offpolicy(args) -> bool:
    return bool(getattr(args, "partial_rollout", False) and getattr(args, "mask_offpolicy_in_partial_rollout", False))


async def run_group(args, front: Front, group: list) -> list:
    """Call each sample's custom generate function as slime's generate_and_rm_group does (one sampling-params
    copy per sample, with slime's per-index seed under deterministic inference, a session id per sample);
    requests reach `front` through `args.sglang_router_ip/port`. Returns what the functions returned (a
    `Sample` or a `list[Sample]` each)."""
    base, seeds = attach.sampling_from_args(args), attach.group_seeds(args)
    for s in group:
        if getattr(s, "session_id", "") is None:   # slime: one session id per sample
            s.session_id = str(uuid.uuid4())
    tasks = []
    for i, s in enumerate(group):
        sp = dict(base)
        if seeds:
            sp["sampling_seed"] = seeds[i % len(seeds)]
        tasks.append(_call(args, load(custom_path(args, s)), s, sp))
    return list(await asyncio.gather(*tasks))


def versions(returned: list, tracks: list, prompt_len: int, held: dict) -> tuple:
    """Which weight version sampled which response tokens of each sample the functions returned (a
    `list[Sample]` opened), as SGLang's spans over its response: the answers of the sample's track (the one
    whose tokens, or text, it starts with; one not matched yet first). Tokens of the function's own (a tool's
    observation) are in no span; tokens held before the call (`held`: id(sample) -> (response_length,
    weight_versions)) take its first version. `Sample.weight_versions` gets one entry per answer, as slime
    fills it, where the function added none. Returns (spans per sample, every track's spans, whether every
    answer named its tokens' versions)."""
    used, out = set(), []
    for s in flat(returned):
        t = _match(s, tracks, used)
        n0, wv0 = held.get(id(s), (0, []))
        seq = list(s.tokens or [])
        start0, end = (len(seq) - s.response_length, s.response_length) if seq else (prompt_len, math.inf)
        spans = [{"version": (wv0 or [None])[0], "start": 0, "end": n0}] if n0 else []
        for sp in t.spans if t is not None else ():
            a, b = max(n0, sp["start"] - start0), min(end, sp["end"] - start0)
            if b > a:
                spans.append({"version": sp["version"], "start": a, "end": b})
        if t is not None:
            used.add(id(t))
            if len(s.weight_versions or []) == len(wv0):
                s.weight_versions = list(s.weight_versions or []) + t.versions
        out.append(spans)
    return out, [t.spans for t in tracks], all(t.spanned for t in tracks)


def _match(sample, tracks: list, used: set) -> Optional[_Track]:
    seq = list(sample.tokens or [])
    text = (sample.prompt if isinstance(sample.prompt, str) else "") + (sample.response or "")

    def fits(t):
        return bool(seq and t.known and seq[:len(t.known)] == t.known or t.text and text.startswith(t.text))
    return max((t for t in tracks if fits(t)), key=lambda t: (id(t) not in used, len(t.known)), default=None)


class CustomSink(Sink):
    """The adapter's sink for groups the user's functions generated: the slime group is what they returned
    (nothing to fill in); a FAILED turn is the front's."""

    def fill(self, group, slime_group) -> Optional[str]:
        bad = [s for s in group.samples if s.status is SampleStatus.FAILED]
        if not bad:
            return None
        first = slime_group[0][0] if isinstance(slime_group[0], list) else slime_group[0]
        return failure_line(first, bad[0], f"a request of group {first.group_index} (custom generate function)")


class Step:
    """The custom-generate path of one `generate_rollout` call: the adapter's seats, refill and partial rollout
    (`Sink`, `RolloutManager.rollout(run=...)`, `partial.recycle`), each group generated by the user's
    functions, their requests answered by the front. `background`: the fully-async pool's (module doc)."""

    def __init__(self, args, backend, tokenizer, pending: dict, background: bool = False):
        self.args, self.backend, self.tokenizer, self.pending = args, backend, tokenizer, pending
        self.front = _front(backend, tokenizer)
        self.requests0 = self.front.requests
        self.running, self.saved = 0, None   # groups whose functions run now; slime's router address
        self.background, self.turns = background, {}   # group id -> `versions` of what its functions returned
        self.fn_args = None                  # background: the functions' copy of args, pointing at the front
        if background:
            self.fn_args = copy.copy(args)
            self.fn_args.sglang_router_ip, self.fn_args.sglang_router_port = "127.0.0.1", self.front.port

    def sink(self, target: int) -> CustomSink:
        return CustomSink(self.args, self.pending, self.backend.layout, target)

    def group(self, slime_group: list):
        """The manager group standing for a slime group (its prompt; samples already finished are not run)."""
        first = slime_group[0]
        ids = prompt_ids(first, self.tokenizer)
        group = self.backend.new_group(ids[:len(ids) - first.response_length] if first.tokens else ids)
        for ms, s in zip(group.samples, slime_group):
            if s.status in (s.Status.COMPLETED, s.Status.TRUNCATED):
                ms.status = SampleStatus.COMPLETED
        return group

    def open(self, groups: list, slime_groups: list) -> None:
        for g, sg in zip(groups, slime_groups):
            self.front.open_group(g.group_id, g.prompt_ids, sg[0].prompt, resume=self.background)

    async def run(self, group) -> None:
        """The manager's `run`: the group's functions, cut short at its first FAILED turn; the manager samples
        then say where its turns ran and that it is done (or FAILED): when the batch is full meanwhile the
        manager carries it (its samples as the functions left them, aborted ones included)."""
        if not self.running and self.fn_args is None:   # slime's router address points at the front meanwhile
            self.saved = (self.args.sglang_router_ip, self.args.sglang_router_port)
            self.args.sglang_router_ip, self.args.sglang_router_port = "127.0.0.1", self.front.port
        self.running += 1
        failed = self.front.watch(group.group_id)
        held = {id(s): (s.response_length, list(s.weight_versions or [])) for s in self.pending[group.group_id]}
        work = asyncio.ensure_future(run_group(self.fn_args or self.args, self.front, self.pending[group.group_id]))
        waiter = asyncio.ensure_future(failed.wait())
        try:
            await asyncio.wait([work, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not work.done():   # a FAILED turn (slime's post would retry it for a minute): stop the functions
                work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            self.running -= 1
            if not self.running and self.fn_args is None:
                self.args.sglang_router_ip, self.args.sglang_router_port = self.saved
        bad = self.front.failures.pop(group.group_id, None)
        if bad is None:
            self.pending[group.group_id] = work.result()   # raises what the user's function raised
        tracks = self.front.close_group(group.group_id)
        if self.background and bad is None:
            self.turns[group.group_id] = versions(self.pending[group.group_id], tracks, len(group.prompt_ids), held)
        for i, ms in enumerate(group.samples):
            t = tracks[i] if i < len(tracks) else None
            ms.engines, ms.dp_rank = (list(t.engines), t.dp_rank) if t else ([], None)
            ms.status, ms.error = SampleStatus.COMPLETED, None
        if bad is not None:
            ms = group.samples[0]
            ms.status, ms.error, ms.engines = SampleStatus.FAILED, bad.error, list(bad.engines)

    def close(self) -> None:
        """After `partial.recycle`: groups still held are dropped, as slime drops aborted groups without
        `--partial-rollout`."""
        for g in self.backend.drop_carried():
            self.pending.pop(g.group_id, None)
            self.front.close_group(g.group_id)

    def metrics(self) -> dict:
        return {"rollout/custom_generate_requests": self.front.requests - self.requests0}


def _front(backend, tokenizer) -> Front:
    """The front of the adapter's current backend (a new one after attaching again), on the adapter's loop."""
    front = _FRONT.get("front")
    if front is None or front.backend is not backend or front.tokenizer is not tokenizer:
        if front is not None:
            loop().run(front.stop())
        front = _FRONT["front"] = loop().run(Front(backend, tokenizer).start())
    return front


_FRONT: dict = {}   # "front": the Front of the adapter's current backend (on the adapter's loop)
