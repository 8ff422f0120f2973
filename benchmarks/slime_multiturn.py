"""A 3-turn generate function of slime's style, plugin mode vs slime's own rollout, on the same real engines.

The function (`three_turns`, here) is written as slime's agentic examples are: it posts to
`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` with `slime.utils.http_utils.post`,
appends each answer's tokens (loss mask 1) and, between turns, a tool observation of `--obs-len` tokens
(loss mask 0), then posts the whole sequence again; 3 turns. Prompts: a `--system-len`-token system prompt
shared by every group, then a `--user-len`-token question per group; groups of 8; a reward that awaits
`--reward-s` seconds (`awaiting_reward`). A turn's length varies per sample and turn (`turn_budget`, the
same in both arms; `ignore_eos`), so a step's samples do not move in lock-step as equal lengths would make
them. Both arms run in one worker under SLIME_PYTHON (slime importable, as scripts/check_against_slime.sh):
slime's router (`_start_router`, PyPI's sglang-router) and one
`SGLangEngine.init` per engine, then, alternated, one training step of each arm:
  ours:   `rollout.slime.generate_rollout` with `--custom-generate-function-path slime_multiturn.three_turns`
          (plugin mode: the turns reach the manager through its loopback front, placed per group);
  slime:  slime's own `slime.rollout.sglang_rollout.generate_rollout`, the same function, through slime's router.
The engines: `--engines` of the DP-attention miniature (training_configs/tiny-cpu-dpattn.yaml: dp 2, NEXTN,
chunk 4,096), started once, caches flushed before every step; `--warmups` steps of each arm (2) are not
counted.
The data source is a STAND-IN that hands slime Samples whose `tokens` are the prompt ids. Neither arm asks
for routed experts (every PyPI sglang-router drops `return_routed_experts`, so slime's arm could not get them).

    flock /tmp/engine.lock python benchmarks/slime_multiturn.py --slime-src /tmp/slime-src [--rounds 2]
    python benchmarks/slime_multiturn.py --dry      # the judging on recorded figures, no engine, no slime

Printed and judged, ours / slime's: prompt tokens prefilled per turn (`prompt_tokens - cached_tokens` of
each turn's answer `meta_info`; ours adds its placement's primers); generated tokens/s (tokens over the
time from the step's start to its last answered turn); step time (the whole rollout call, the reward
included). Without a slime checkout or SLIME_PYTHON it prints why and judges nothing (run_all counts
that as a missing line).
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from _slime_arm import Worker, say, say_error, start_client, unavailable  # noqa: E402
from _targets import fact, finish, judge  # noqa: E402

BENCH = "slime_multiturn"
TURNS = 3
GROUP = 8
REWARD_ENV, OBS_ENV = "SLIME_MULTITURN_REWARD_S", "SLIME_MULTITURN_OBS_LEN"


# ------------------------------------------------------------------ the user's side (slime's style)
def observation(tokens: list, n: int) -> list:
    """The tool's answer to a sequence: `n` token ids that depend on what the model said."""
    rng = random.Random(hash(tuple(tokens[-8:])))
    return [rng.randrange(3, 300) for _ in range(n)]


def turn_budget(index: int, turn: int, mean: int) -> int:
    """A turn's answer length, as an agent's turns vary (the model stops at a tool call or an answer): the same
    for a sample's turn in both arms, between half and one and a half times `--turn-tokens`."""
    return random.Random(index * 7919 + turn).randint(*turn_budget_range(mean))


def turn_budget_range(mean: int) -> tuple:
    return max(1, mean // 2), mean + mean // 2


async def three_turns(args, sample, sampling_params):
    """A custom generate function as slime's examples write one: 3 turns, a tool observation (loss mask 0)
    between them. Each turn's meta_info counts go to `sample.metadata["turns"]`: [turn, prompt_tokens,
    cached_tokens, tokens generated, when, NEXTN verify steps]."""
    from slime.utils.http_utils import post

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    obs_len = int(os.environ.get(OBS_ENV, "64"))
    prompt = list(sample.tokens)
    ids, mask, logprobs, turns = list(prompt), [], [], []
    for turn in range(TURNS):
        budget = turn_budget(sample.index, turn, int(sampling_params["max_new_tokens"]))
        out = await post(url, {"input_ids": ids, "return_logprob": True,
                               "sampling_params": dict(sampling_params, max_new_tokens=budget, ignore_eos=True)})
        meta = out["meta_info"]
        new = [t for _, t, _ in meta["output_token_logprobs"]]
        turns.append([turn, int(meta["prompt_tokens"]), int(meta.get("cached_tokens") or 0), len(new),
                      time.monotonic(), int(meta.get("spec_verify_ct") or 0)])
        ids += new
        mask += [1] * len(new)
        logprobs += [lp for lp, _, _ in meta["output_token_logprobs"]]
        if turn < TURNS - 1:
            obs = observation(ids, obs_len)
            ids += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
    sample.tokens, sample.response_length, sample.loss_mask = ids, len(ids) - len(prompt), mask
    sample.rollout_log_probs = logprobs
    sample.metadata = dict(sample.metadata or {}, turns=turns)
    sample.status = sample.Status.COMPLETED
    return sample


async def awaiting_reward(args, sample):
    """A reward that awaits (a judge, a sandbox): `$SLIME_MULTITURN_REWARD_S` seconds."""
    await asyncio.sleep(float(os.environ.get(REWARD_ENV, "0.5")))
    return float(sum(sample.loss_mask))


# ------------------------------------------------------------------ figures and judging
def summarise(step: dict) -> dict:
    """One step's figures from the worker's answer: prefilled tokens per turn, tokens/s, step seconds."""
    turns = [list(t[:5]) + [t[5] if len(t) > 5 else 0] for t in step["turns"]]
    prefilled = sum(p - c for _, p, c, *_ in turns) + step.get("primer_prefilled", 0)
    gen_s = max(t[4] for t in turns)
    tokens, verified = sum(t[3] for t in turns), sum(t[5] for t in turns)
    return {"prefill_per_turn": prefilled / len(turns), "tokens_per_s": tokens / gen_s,
            "step_s": step["seconds"], "turns": len(turns), "cpu_s": step.get("cpu_s"),
            "per_verify": tokens / verified if verified else None,   # NEXTN: tokens per decode step of a sample
            "ends": [max(t[4] for t in turns if t[0] == i) for i in range(TURNS)],
            "by_turn": [sum(t[1] - t[2] for t in turns if t[0] == i) / max(1, sum(t[0] == i for t in turns))
                        for i in range(TURNS)]}


def report(res: dict) -> None:
    """Judge ours / slime's on the mean of each arm's steps."""
    mean = lambda arm, k: sum(s[k] for s in res[arm]) / len(res[arm])  # noqa: E731
    for arm in ("ours", "slime"):
        pv = [s["per_verify"] for s in res[arm] if s["per_verify"]]
        fact(BENCH, f"{arm}: prefilled per turn {mean(arm, 'prefill_per_turn'):.1f} tokens, "
                    f"{mean(arm, 'tokens_per_s'):.1f} tokens/s, step {mean(arm, 'step_s'):.2f} s "
                    f"({len(res[arm])} step(s)); NEXTN tokens per verify step "
                    f"{f'{sum(pv) / len(pv):.2f}' if pv else 'not reported'}; client CPU "
                    f"{sum(s['cpu_s'] or 0 for s in res[arm]) / len(res[arm]):.2f} s per step")
    judge(BENCH, "prefill_per_turn", mean("ours", "prefill_per_turn") / mean("slime", "prefill_per_turn"))
    judge(BENCH, "tokens_per_s", mean("ours", "tokens_per_s") / mean("slime", "tokens_per_s"))
    judge(BENCH, "step_time", mean("ours", "step_s") / mean("slime", "step_s"))


# ------------------------------------------------------------------ the run
def prompts(groups: int, system: list, user_len: int, seed: int) -> list:
    rng = random.Random(seed)
    return [system + [rng.randrange(3, 300) for _ in range(user_len)] for _ in range(groups)]


def start_worker(a, cfg_path, model, addrs) -> Worker:
    """Both arms under SLIME_PYTHON (this file with --worker, `_slime_arm.Worker`): one step per request."""
    overrides = {"n_samples_per_prompt": GROUP, "sglang_server_concurrency": 16,
                 "use_rollout_routing_replay": False,   # PyPI's sglang-router drops them: neither arm asks
                 "rollout_max_response_len": a.turn_tokens, "custom_generate_function_path": f"{BENCH}.three_turns",
                 "custom_rm_path": f"{BENCH}.awaiting_reward"}
    return Worker(a.slime_src, [os.path.abspath(__file__), "--worker", cfg_path, model, json.dumps(overrides), *addrs],
                  paths=(HERE,), env={REWARD_ENV: str(a.reward_s), OBS_ENV: str(a.obs_len)})


PROBE_S = 120.0


def quiet_probes(cfg) -> None:
    """The benchmark's own manager only starts the engines and flushes their caches: its health probes (a
    one-token `/generate` every `health.interval_s`, 2 s in the tiny config) would run inside both arms' timed
    steps, a prefill each on the ranks that serve them."""
    cfg.rollout.health.interval_s = max(cfg.rollout.health.interval_s, PROBE_S)


def run(a) -> dict:
    from group_placement_engines import _engine_config, _flush
    from rollout.config import preset_path

    from _tiny import started_manager

    cfg, model = _engine_config(argparse.Namespace(engine_new_tokens=a.turn_tokens))
    cfg.engine_groups[0].engines = a.engines
    quiet_probes(cfg)
    system = [random.Random(1).randrange(3, 300) for _ in range(a.system_len)]
    lo, hi = turn_budget_range(a.turn_tokens)
    print(f"{BENCH}: {a.engines} x tiny-cpu-dpattn (dp 2, NEXTN, chunk 4096); {a.groups} groups x {GROUP} x "
          f"{TURNS} turns of {lo}-{hi} tokens, {a.obs_len}-token observations, {a.system_len}-token system "
          f"prompt + {a.user_len}-token question, reward awaits {a.reward_s:g} s; starting...", flush=True)
    res: dict = {"ours": [], "slime": []}

    async def main():
        mgr = await started_manager(cfg, model, "slime-multiturn-")
        worker = None
        try:
            addrs = [e.url.split("://", 1)[1] for e in mgr.source.engines.values()]
            worker = await asyncio.to_thread(start_worker, a, preset_path("c"), model, addrs)
            print(f"  {worker.ready['ready']}", file=sys.stderr, flush=True)

            async def one(arm, seed, counted, r=0):
                await _flush(mgr, 600.0)   # health probes keep a request pending on a loaded machine
                out = await asyncio.to_thread(worker.ask, {"arm": arm, "rollout_id": seed,
                                                           "prompts": prompts(a.groups, system, a.user_len, seed)})
                assert out["groups"] == a.groups and len(out["turns"]) == a.groups * GROUP * TURNS, out
                fig = summarise(out)
                if counted:
                    res[arm].append(fig)
                print(f"  {arm:5s} {'round ' + str(r) if counted else 'warm-up'}: prefilled per turn "
                      f"{fig['prefill_per_turn']:.1f} (turns 1-3: {', '.join(f'{x:.1f}' for x in fig['by_turn'])}"
                      f"{', primers ' + str(out['primer_prefilled']) if arm == 'ours' else ''}), "
                      f"{fig['tokens_per_s']:.1f} tokens/s ({fig['per_verify'] or 0:.2f} per verify step), turns "
                      f"done at {', '.join(f'{x:.1f}' for x in fig['ends'])} s, step {fig['step_s']:.2f} s, client CPU "
                      f"{fig['cpu_s'] or 0:.2f} s", flush=True)
            for w in range(a.warmups):
                for i, arm in enumerate(("ours", "slime")):
                    await one(arm, 7 + 2 * w + i, False)
            for r in range(a.rounds):
                for arm in (("ours", "slime") if r % 2 == 0 else ("slime", "ours")):
                    await one(arm, 100 + 10 * r + (arm == "slime"), True, r)
        finally:
            if worker:
                worker.close()
            await mgr.stop()
    asyncio.run(main())
    return res


def client_cpu() -> float:
    """CPU seconds of this process and its children (slime's router): the client side of either arm, which
    shares the machine's cores with the CPU engine."""
    import psutil

    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def _worker(cfg_path, model, overrides, addrs) -> int:
    """Runs under SLIME_PYTHON: slime's router and engine registration, then each step of either arm."""
    from slime.rollout import sglang_rollout
    from slime.utils.types import Sample

    import rollout.slime as plugin
    from rollout.slime.state import STATE

    class Prompts:
        """STAND-IN for slime's RolloutDataSource: the benchmark's prompt ids, GROUP samples each."""

        def __init__(self, groups, n):
            self.groups, self.n = groups, n

        def get_samples(self, k):
            out, self.groups = self.groups[:k], self.groups[k:]
            return [[Sample(group_index=g, index=g * self.n + j, prompt="", tokens=list(p)) for j in range(self.n)]
                    for g, p in enumerate(out)]

        def add_samples(self, groups):
            pass

    try:
        args, ready = start_client(cfg_path, model, overrides, addrs)
        os.environ["SLIME_MOE_ROLLOUT_CONFIG"] = cfg_path
        say(ready=ready)
    except Exception as e:
        say_error(e)
        return 1
    for line in sys.stdin:
        req = json.loads(line)
        args.rollout_batch_size = args.over_sampling_batch_size = len(req["prompts"])
        source = Prompts(req["prompts"], args.n_samples_per_prompt)
        placement = lambda: getattr(getattr(STATE.backend, "dispatcher", None), "placement", None)  # noqa: E731
        primed0 = placement().primer_prefilled if placement() else 0
        cpu0, t0 = client_cpu(), time.monotonic()
        try:
            fn = plugin.generate_rollout if req["arm"] == "ours" else sglang_rollout.generate_rollout
            out = fn(args, req["rollout_id"], source)
        except Exception as e:
            say_error(e, f"{req['arm']}: ")
            return 1
        dt, cpu = time.monotonic() - t0, client_cpu() - cpu0
        samples = [s for g in out.samples for s in g]
        primed = (placement().primer_prefilled - primed0) if req["arm"] == "ours" and placement() else 0
        say(seconds=dt, cpu_s=cpu, groups=len(out.samples), primer_prefilled=primed,
            turns=[t[:4] + [t[4] - t0] + t[5:] for s in samples for t in s.metadata["turns"]],
            rewards=sorted({s.reward for s in samples}))
    plugin.reset()
    return 0


DRY = {   # recorded figures of one step per arm, in the worker's answer shape, for --dry
    "ours": {"seconds": 10.5, "primer_prefilled": 290, "turns": [[k, 300 + 80 * k, 290 + 80 * k, 16, 10.0]
                                                                for k in range(TURNS) for _ in range(16)]},
    "slime": {"seconds": 10.4, "primer_prefilled": 0, "turns": [[k, 300 + 80 * k, 150 + 40 * k, 16, 10.0]
                                                              for k in range(TURNS) for _ in range(16)]},
}


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return _worker(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmups", type=int, default=2, help="steps of each arm not counted (CPU engine: the first "
                    "steps of each new batch shape are slow)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--obs-len", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--reward-s", type=float, default=0.5)
    ap.add_argument("--slime-src", default=os.environ.get("SLIME_SRC") or None,
                    help="a slime checkout (default: $SLIME_SRC); both arms need slime importable")
    ap.add_argument("--dry", action="store_true", help="judge recorded figures (no engine, no slime)")
    a = ap.parse_args(argv)
    if min(a.rounds, a.groups, a.engines, a.turn_tokens) < 1 or a.warmups < 0 or a.obs_len < 64 or a.system_len < 256:
        ap.error("--rounds, --groups, --engines, --turn-tokens must be >= 1; --warmups >= 0; --obs-len >= 64, "
                 "--system-len >= 256")
    if a.dry:
        fact(BENCH, "dry run: recorded figures, no engine")
        report({arm: [summarise(step)] for arm, step in DRY.items()})
        return finish()
    why = unavailable(a.slime_src)
    if why:
        fact(BENCH, f"not run: {why} (both arms run slime's code)")
        return 0
    report(run(a))
    return finish()


if __name__ == "__main__":
    sys.exit(main())
