"""slime's OWN generate_rollout as a benchmark arm (`--slime-src DIR`), on the benchmark's engines.

slime's client needs an SGLang it supports (0.5.15.post1) and its client deps, so it runs in a worker
process under SLIME_PYTHON (default /tmp/venv-slime/bin/python, as scripts/check_against_slime.sh),
started once per benchmark: slime's router (`_start_router`), one `SGLangEngine.init` per engine
(external mode: server-args check, router registration), then one `generate_rollout(args, k,
data_source)` per request on stdin, timed around that call. The data source is a STAND-IN that hands
slime Samples whose `tokens` are the benchmark's prompt ids (slime reuses them as the prompt); the only
addition to slime's request is `ignore_eos`, so every arm generates the same number of tokens.
Each answer also carries the prompt tokens and cached tokens of every sample, summed from slime's own
`Sample.prefix_cache_info` (slime adds each answer's `meta_info` `prompt_tokens` / `cached_tokens` there).
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLIME_PYTHON = os.environ.get("SLIME_PYTHON", "/tmp/venv-slime/bin/python")


def unavailable(slime_src) -> str | None:
    """Why slime's arm cannot run (None when it can)."""
    if not slime_src:
        return "no slime checkout given (SLIME_SRC or --slime-src)"
    if not os.path.isdir(os.path.join(slime_src, "slime")):
        return f"--slime-src {slime_src} has no slime/ package"
    if not os.path.exists(SLIME_PYTHON):
        return f"SLIME_PYTHON {SLIME_PYTHON} missing (see scripts/check_against_slime.sh)"
    return None


def parse_reply(line: str):
    """The worker's answer on one stdout line (a dict), None for any other line; its error raises."""
    if not line.startswith("SLIME-ARM "):
        return None
    out = json.loads(line.split(" ", 1)[1])
    if "error" in out:
        raise RuntimeError(f"slime arm: {out['error']}")
    return out


def worker_env(slime_src: str, *paths: str) -> dict:
    """The environment of a worker under SLIME_PYTHON: the checkout, scripts/, `paths`, slime and a STUB wandb
    package (slime imports it; it is not installed there) on PYTHONPATH."""
    stubs = tempfile.mkdtemp(prefix="slime-arm-stubs-")
    os.makedirs(os.path.join(stubs, "wandb"))
    with open(os.path.join(stubs, "wandb", "__init__.py"), "w") as f:
        f.write('"""STUB (benchmarks/_slime_arm.py): wandb is not installed; slime only imports it."""\n')
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), *paths, slime_src,
                                                        stubs]))


class Worker:
    """A worker process under SLIME_PYTHON: `argv` after the interpreter, one JSON request per stdin line, its
    answer (`parse_reply`) back; `env` is added to `worker_env(slime_src, *paths)`. `ready` is its first answer."""

    def __init__(self, slime_src: str, argv: list, paths: tuple = (), env: dict | None = None):
        why = unavailable(slime_src)
        if why:
            raise SystemExit(f"error: {why}")
        self.log = tempfile.NamedTemporaryFile(prefix="slime-arm-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([SLIME_PYTHON, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env={**worker_env(slime_src, *paths), **(env or {})},
                                     cwd=ROOT)
        self.ready = self._reply()

    def _reply(self) -> dict:
        said = []   # its other stdout lines (attach_slime's "[FAILED] ..." among them)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                with open(self.log.name) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"slime arm worker exited (rc {self.proc.returncode}):\n{tail}"
                                   + "".join(said[-5:]))
            out = parse_reply(line)
            if out is not None:
                return out
            said.append(line)

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class SlimeArm(Worker):
    def __init__(self, slime_src: str, cfg_path: str, model: str, addrs: list, max_new_tokens: int,
                 overrides: dict | None = None):
        """`overrides`: slime arguments set over those of the config (e.g. n_samples_per_prompt)."""
        super().__init__(slime_src, [os.path.abspath(__file__), cfg_path, model,
                                     json.dumps({"rollout_max_response_len": max_new_tokens, **(overrides or {})}),
                                     *addrs])   # ready: "slime client: SGLang X, router host:port"

    def answer(self, prompts: list, rollout_id: int, budgets: list | None = None) -> dict:
        """One generate_rollout of `prompts`: seconds inside it, groups returned, tokens generated,
        prompt_tokens and cached_tokens summed over every sample. `budgets`: per prompt, each sample's
        own max_new_tokens (see `_worker`)."""
        return self.ask({"prompts": prompts, "rollout_id": rollout_id, "budgets": budgets})

    def rollout(self, prompts: list, rollout_id: int) -> tuple:
        """(seconds inside slime's generate_rollout, tokens generated, groups returned)."""
        out = self.answer(prompts, rollout_id)
        return out["seconds"], out["tokens"], out["groups"]


def say(**kw):
    """A worker's answer line (read by `parse_reply`)."""
    print("SLIME-ARM " + json.dumps(kw), flush=True)


def say_error(e: BaseException, prefix: str = "") -> None:
    say(error=f"{prefix}{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


def start_client(cfg_path: str, model: str, overrides: dict, addrs: list):
    """Under SLIME_PYTHON: slime's args for the config (`overrides` over them), then slime's own start-up against
    the engines at `addrs` (`check_against_slime.attach_slime`: its HTTP client, its router, one
    `SGLangEngine.init` per engine). Returns (args, the ready line)."""
    import sglang
    from check_against_slime import attach_slime, slime_args

    from training_configs.schema import load_config

    args = slime_args(load_config(cfg_path), model, addrs)
    vars(args).update(overrides)
    infos = attach_slime(args, addrs)
    return args, (f"slime client: SGLang {sglang.__version__}, router {args.sglang_router_ip}:"
                  f"{args.sglang_router_port}, {len(infos)} engine(s)")


def _worker(cfg_path, model, overrides, addrs):
    """Runs under SLIME_PYTHON: slime's router, engine registration and generate_rollout."""
    import time

    from slime.rollout import sglang_rollout
    from slime.utils.types import Sample

    class Prompts:
        """STAND-IN for slime's RolloutDataSource: the benchmark's prompt ids, n samples each. With
        `budgets`, a sample of budget b is handed over as if rollout_max_response_len - b tokens of its
        response were already there (slime asks for max_new_tokens minus `response_length`; masks and
        logprobs padded to match), and those are not counted as generated."""

        def __init__(self, prompts, n, budgets=None, most=0):
            self.prompts, self.n, self.budgets, self.most = prompts, n, budgets, most

        def sample(self, g, j, p):
            off = self.most - self.budgets[g][j] if self.budgets else 0
            return Sample(group_index=g, index=g * self.n + j, prompt="", tokens=list(p), response_length=off,
                          loss_mask=[1] * off if off else None, rollout_log_probs=[0.0] * off if off else None)

        def get_samples(self, k):
            out, self.prompts = self.prompts[:k], self.prompts[k:]
            return [[self.sample(g, j, p) for j in range(self.n)] for g, p in enumerate(out)]

        def add_samples(self, groups):
            pass

    try:
        args, ready = start_client(cfg_path, model, overrides, addrs)
        state = sglang_rollout.GenerateState(args)
        state.sampling_params["ignore_eos"] = True
        say(ready=ready)
    except Exception as e:
        say_error(e)
        return 1
    for line in sys.stdin:
        req = json.loads(line)
        args.rollout_batch_size = args.over_sampling_batch_size = len(req["prompts"])
        t0 = time.monotonic()
        budgets = req.get("budgets")
        source = Prompts(req["prompts"], args.n_samples_per_prompt, budgets, args.rollout_max_response_len)
        out = sglang_rollout.generate_rollout(args, req["rollout_id"], source)
        dt = time.monotonic() - t0
        samples = [s for g in out.samples for s in g]
        given = sum(args.rollout_max_response_len - b for bs in budgets for b in bs) if budgets else 0
        say(seconds=dt, groups=len(out.samples), tokens=sum(s.response_length for s in samples) - given,
            prompt_tokens=sum(s.prefix_cache_info.total_prompt_tokens for s in samples),
            cached_tokens=sum(s.prefix_cache_info.cached_tokens for s in samples))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]))
