"""Shared by the engine benchmarks: the demo config reduced to one tiny CPU engine, and the two
ways of running one batch on it that the benchmarks put side by side."""
import asyncio
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CONFIG = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")


def one_engine_config(max_new_tokens=None):
    """(cfg, model path): training_configs/tiny-cpu.yaml with 1 engine and generous start-up budgets."""
    from rollout import config as rconfig
    from rollout.cli.engine import model_for

    cfg = rconfig.load(CONFIG)
    cfg.engine_groups[0].engines = 1
    if max_new_tokens is not None:
        cfg.rollout.sampling.max_new_tokens = max_new_tokens
    for k in ("http_s", "server_up_s"):
        setattr(cfg.rollout.budgets, k, 600.0)
    return cfg, model_for(cfg, ROOT)


async def started_manager(cfg, model, prefix, on_created=None):
    """A RolloutManager over the config's engines, started (phased readiness shown on stderr);
    `on_created(mgr)` is called just before the start. Sampling gets ignore_eos, so every arm of a
    benchmark generates exactly max_new_tokens per sample."""
    from rich.console import Console
    from rich.progress import Progress

    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.readiness import RichView
    from rollout.manager import RolloutManager
    from rollout.net import free_port

    ports = [free_port() for _ in range(sum(g.engines for g in cfg.engine_groups))]
    with Progress(console=Console(stderr=True), transient=True) as progress:
        mgr = RolloutManager.from_config(cfg, LocalBackend(tempfile.mkdtemp(prefix=prefix)), model,
                                         ports=ports, view=RichView(progress))
        if on_created:
            on_created(mgr)
        await mgr.start()
    mgr.dispatcher.sampling["ignore_eos"] = True
    return mgr


async def flush_cache(mgr):
    """Empty every engine's prefix cache, so a run never reuses the previous run's prompts."""
    for eng in mgr.source.engines.values():
        await mgr.client.flush_cache(eng)


async def barrier_batch(mgr, prompts):
    """slime's generate_rollout shape: every sample of the batch sent at once behind one
    Semaphore(concurrency x engines), engines round-robin (slime's router), the same /generate body
    (logprobs, routed experts, decoded as slime decodes them); the trainer gets the batch when the
    LAST sample is done. Returns (seconds until the trainer holds data, tokens)."""
    import pybase64
    import torch

    engines = list(mgr.source.engines.values())
    sem = asyncio.Semaphore(mgr.options.concurrency * len(engines))
    sampling, n, tokens, rr = dict(mgr.dispatcher.sampling), mgr.n_samples, [0], [0]

    async def one(p, i, k):
        async with sem:
            eng = engines[rr[0] % len(engines)]
            rr[0] += 1
            body = {"input_ids": p, "sampling_params": sampling, "return_logprob": True,
                    "return_routed_experts": mgr.routed_experts, "rid": f"barrier-{time.monotonic_ns()}-{k}-{i}"}
            out = await mgr.client.generate(eng, body, timeout_s=600)
            tokens[0] += len(out["meta_info"]["output_token_logprobs"])
            routed = out["meta_info"].get("routed_experts")
            if routed is not None:  # slime decodes it per sample (slime/utils/misc.py decode_int32_meta_array)
                torch.frombuffer(bytearray(pybase64.b64decode(routed.encode("ascii"))), dtype=torch.int32)

    t0 = time.monotonic()
    await asyncio.gather(*(one(p, i, k) for k, p in enumerate(prompts) for i in range(n)))
    return time.monotonic() - t0, tokens[0]


async def streamed_batch(mgr, prompts):
    """The manager: groups stream to the trainer-side consumer as they finish.
    Returns (seconds until the first group arrived, seconds for the whole batch, tokens)."""
    from rollout.stream import GroupStream

    stream, arrivals, tokens = GroupStream(maxsize=len(prompts)), [], [0]
    t0 = time.monotonic()

    async def consume():
        async for g in stream:
            arrivals.append(time.monotonic() - t0)
            tokens[0] += sum(len(s.response_ids) for s in g.samples)
            assert all(s.routed_experts is not None for s in g.samples) or not mgr.routed_experts

    c = asyncio.create_task(consume())
    res = await mgr.rollout(prompts, stream, batch_size=len(prompts))
    await stream.close()
    await c
    assert res.delivered == len(prompts) == len(arrivals), (res, len(arrivals))
    return arrivals[0], arrivals[-1], tokens[0]


def slime_arm(args, cfg, model, mgr, cfg_path=CONFIG, overrides=None):
    """slime's own generate_rollout on the manager's engines (None without --slime-src); `cfg_path`
    is the config file `cfg` was loaded from, `overrides` the slime arguments set over it."""
    if not args.slime_src:
        return None
    from _slime_arm import SlimeArm

    addrs = [e.url.split("://", 1)[1] for e in mgr.source.engines.values()]
    arm = SlimeArm(args.slime_src, cfg_path, model, addrs, cfg.rollout.sampling.max_new_tokens, overrides)
    print(f"  {arm.ready['ready']}", file=sys.stderr)
    return arm


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def batch_args(doc: str, pairs: int, slime_help: str):
    """The command line of a tiny-batch benchmark (--groups, --max-new-tokens, --pairs, --slime-src)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=pairs)
    ap.add_argument("--slime-src", help=slime_help)
    a = ap.parse_args()
    if min(a.groups, a.max_new_tokens, a.pairs) < 1:
        ap.error("--groups, --max-new-tokens and --pairs must be >= 1")
    return a
