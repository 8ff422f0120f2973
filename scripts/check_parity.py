"""Parity harness: slime's OWN `generate_rollout` (slime.rollout.sglang_rollout) and plugin mode's
(`rollout.slime.generate_rollout`) on the same real engines, the same args, prompts and seeds; the returned
samples compared field by field (driver of scripts/check_parity.sh; run with slime's Python, slime on PYTHONPATH).

    python scripts/check_parity.py CONFIG MODEL_PATH HOST:PORT [HOST:PORT ...]

Scenarios (PARITY_SCENARIOS=plain,partial,... runs those whose names start so): plain GRPO; over-sampling + a dynamic filter; partial rollout with the off-policy mask; a reward
that awaits; a 2-turn generate function of slime's style with a tool observation (loss mask 0); slime's own
examples/search-r1/generate_with_search.py with a local search STAND-IN (127.0.0.1:8000/retrieve).
Each pair of outputs is compared sample by sample (matched by slime's `index`): tokens, response, response
length, rollout logprobs, loss mask, reward, status, weight versions, metadata, routed experts; and the
metrics' keys. A field equal on both sides prints [equal]; a difference plugin mode makes on purpose prints
[explained] with the reason (`EXPLAINED`); any other difference prints [DIFF] and the exit status is 1.
Where slime's own semantics leave a choice to timing (which of the over-sampled groups fill the batch, where
stragglers are cut), only the samples both sides returned are compared, plus the scenario's invariants; the
reward scenario over-samples one prompt, so its samples are paired by their place in the batch.
Sampling is greedy (temperature 0) with slime's per-index seeds sent (`--sglang-enable-deterministic-inference`
on the client side): the CPU engine refuses deterministic inference (`probe_deterministic`, run by
check_parity.sh with the engines' Python), so logprobs are compared within `LOGPROB_TOL`.
"""
import asyncio
import json
import math
import os
import subprocess
import sys

LOGPROB_TOL = 1e-2   # greedy on the CPU engine without batch-invariant kernels: batch composition moves the last bits
EQUAL_FIELDS = ("tokens", "response", "response_length", "loss_mask", "status", "reward", "weight_versions",
                "metadata")
EXPLAINED = {
    "routed_experts_router": "slime's own path posts through slime's router: every PyPI sglang-router drops "
                             "return_routed_experts (scripts/probe_router_fields.py), so slime's samples have none; "
                             "plugin mode sends to the workers the router lists and gets them",
    "routed_experts_compact": "compact R3 (SLIME_MOE_ROLLOUT_COMPACT_TRAINER=1): plugin mode hands slime uint8 "
                              "compact rows, expanded at replay",
    "prefix_cache_info": "placement: plugin mode keeps a group on one (engine, DP rank), slime's router spreads "
                         "it, so the cached-token counts differ",
    "metrics": "plugin mode adds its own rollout/* metrics beside slime's",
    "cut": "where a straggler is cut is timing (under slime too): each side's continued samples hold loss mask 0 "
           "on exactly the tokens it held when cut, start_rollout_id when it held any (partial rollout invariants, "
           "checked), and one weight version per SGLang answer (the same versions, as many as segments)",
}


# ---------------------------------------------------------------- comparison (pure: tests/test_check_parity.py)
def flat(samples) -> list:
    """A rollout output's samples, groups and a custom function's list[Sample] opened."""
    out = []
    for x in samples:
        out += flat(x) if isinstance(x, list) else [x]
    return out


def _value(sample, name):
    v = getattr(sample, name, None)
    if name == "status":
        return getattr(v, "value", v)
    if name == "metadata":
        return {k: val for k, val in (v or {}).items()}
    return v


def _rows(x):
    if x is None:
        return None
    return x.tolist() if hasattr(x, "tolist") else list(x)


def compare_experts(a, b, asked: bool):
    """(verdict, detail) for rollout_routed_experts of slime's sample `a` and plugin mode's `b`."""
    ra, rb = getattr(a, "rollout_routed_experts", None), getattr(b, "rollout_routed_experts", None)
    if ra is None and rb is None:
        return "equal", None
    if ra is None and asked:
        return "explained", "routed_experts_router"
    if ra is None or rb is None:
        return "DIFF", f"routed experts: slime {'none' if ra is None else 'some'}, ours {'none' if rb is None else 'some'}"
    if "uint8" in str(getattr(rb, "dtype", "")):
        return "explained", "routed_experts_compact"
    return ("equal", None) if _rows(ra) == _rows(rb) else ("DIFF", "routed experts rows differ")


def compare_samples(a, b, asked_experts: bool) -> list:
    """[(verdict, field, detail)] for slime's sample `a` and plugin mode's `b` (the same index)."""
    out = []
    for name in EQUAL_FIELDS:
        va, vb = _value(a, name), _value(b, name)
        if name == "reward" and isinstance(va, float) and isinstance(vb, float):
            same = math.isclose(va, vb, rel_tol=0, abs_tol=1e-9)
        else:
            same = va == vb
        out.append(("equal", name, None) if same else ("DIFF", name, f"slime {va!r:.120} ours {vb!r:.120}"))
    la, lb = getattr(a, "rollout_log_probs", None) or [], getattr(b, "rollout_log_probs", None) or []
    if len(la) != len(lb):
        out.append(("DIFF", "rollout_log_probs", f"lengths {len(la)} vs {len(lb)}"))
    else:
        gap = max((abs(x - y) for x, y in zip(la, lb)), default=0.0)
        out.append(("equal", "rollout_log_probs", f"max |diff| {gap:.2g}") if gap <= LOGPROB_TOL else
                   ("DIFF", "rollout_log_probs", f"max |diff| {gap:.3g} > {LOGPROB_TOL}"))
    verdict, detail = compare_experts(a, b, asked_experts)
    out.append((verdict, "rollout_routed_experts", detail))
    pa, pb = getattr(a, "prefix_cache_info", None), getattr(b, "prefix_cache_info", None)
    out.append(("equal", "prefix_cache_info", None) if pa == pb else ("explained", "prefix_cache_info",
                                                                      "prefix_cache_info"))
    return out


def _cut_only(field, a, b) -> bool:
    """A continued sample's `field` differs only where the cut fell: the loss mask; the weight versions (one per
    answer: the same versions, a different count); the metadata but for start_rollout_id."""
    if field == "loss_mask":
        return True
    if field == "weight_versions":
        va, vb = a.weight_versions or [], b.weight_versions or []
        return bool(va) and bool(vb) and set(va) == set(vb)
    if field == "metadata":
        strip = lambda s: {k: v for k, v in _value(s, "metadata").items() if k != "start_rollout_id"}  # noqa: E731
        return strip(a) == strip(b)
    return False


def compare_outputs(slime_out, ours_out, *, asked_experts: bool, same_groups: bool, cut=(),
                    by_order: bool = False) -> list:
    """[(verdict, field, detail)] for two RolloutFnTrainOutputs. `same_groups`: slime's semantics fix which groups
    fill the batch (else only the samples both returned are compared, and the group counts). `cut`: indices of
    samples continued from slime's buffer on either side: their loss masks hold zeros on the tokens each side
    held when its straggler was cut (timing, checked by `partial_invariants`), their weight versions count the
    answers and start_rollout_id says whether they held tokens (`_cut_only`), not compared with each other.
    `by_order`: every group holds the same prompt (greedy: the same completion), so samples are paired by their
    place in the batch, whichever groups filled it."""
    out = []
    ga, gb = slime_out.samples, ours_out.samples
    if len(ga) != len(gb):
        out.append(("DIFF", "groups", f"slime returned {len(ga)} groups, ours {len(gb)}"))
    sa = {s.index: s for s in flat(ga)}
    sb = {s.index: s for s in flat(gb)}
    if by_order:
        sa, sb = (dict(enumerate(sorted(x.values(), key=lambda s: s.index))) for x in (sa, sb))
    if same_groups and set(sa) != set(sb):
        out.append(("DIFF", "indices", f"slime {sorted(sa)} ours {sorted(sb)}"))
    both = sorted(set(sa) & set(sb))
    if not both:
        out.append(("DIFF", "indices", f"no sample index returned by both: slime {sorted(sa)} ours {sorted(sb)}"))
    for i in both:
        for v, f, d in compare_samples(sa[i], sb[i], asked_experts):
            if v == "DIFF" and i in cut and _cut_only(f, sa[i], sb[i]):
                v, d = "explained", "cut"
            out.append((v, f, f"index {i}: {d}" if v == "DIFF" else d))
    ka, kb = set(slime_out.metrics or {}), set(ours_out.metrics or {})
    if ka - kb:
        out.append(("DIFF", "metrics keys", f"slime's {sorted(ka - kb)} missing from ours"))
    else:
        out.append(("equal", "metrics keys", f"slime's {sorted(ka)}"))
    if kb - ka:
        out.append(("explained", "extra metrics keys", "metrics"))
    return out


def same_prompt_same_tokens(*outputs) -> list:
    """Greedy sampling: every sample of a prompt, on either side, in every step, holds the same tokens.
    [(verdict, field, detail)]."""
    seen, out = {}, []
    for s in (s for o in outputs for s in flat(o.samples)):
        key = s.prompt if isinstance(s.prompt, str) else json.dumps(s.prompt)
        if key in seen and seen[key] != list(s.tokens):
            out.append(("DIFF", "tokens", f"prompt {key[:40]!r}: {seen[key]} vs {list(s.tokens)}"))
        seen.setdefault(key, list(s.tokens))
    return out or [("equal", "tokens by prompt", f"{len(seen)} prompts, one greedy completion each")]


def summarize(scenario: str, results: list) -> tuple:
    """The lines to print for one scenario, and whether it has an unexplained difference."""
    lines, bad = [], False
    by = {}
    for verdict, field, detail in results:
        by.setdefault((verdict, field), []).append(detail)
    for (verdict, field), details in sorted(by.items(), key=lambda kv: ("DIFF", "explained", "equal").index(kv[0][0])):
        if verdict == "DIFF":
            bad = True
            lines.append(f"[DIFF] {scenario}: {field}: {details[0]}" + (f" (+{len(details) - 1} more)"
                                                                          if len(details) > 1 else ""))
        elif verdict == "explained":
            key = details[0]
            lines.append(f"[explained] {scenario}: {field}: {EXPLAINED.get(key, key)}")
    equal = sorted({f for (v, f) in by if v == "equal"} - {f for (v, f) in by if v != "equal"})
    notes = [d for (v, f), ds in by.items() if v == "equal" for d in ds if d and f in ("rollout_log_probs",)]
    gap = max((float(n.split()[-1]) for n in notes), default=None)
    lines.insert(0, f"[equal] {scenario}: {', '.join(equal)}" + (f" (logprobs max |diff| {gap:.2g})"
                                                                  if gap is not None else ""))
    return lines, bad


# ---------------------------------------------------------------- the deterministic-inference probe
PROBE = """
import sys
from sglang.srt.server_args import ServerArgs
try:
    from sglang.srt.arg_groups.attention_hook import handle_deterministic_inference as check
except ImportError:
    check = ServerArgs._handle_deterministic_inference
try:   # 0.5.15-0.5.2x check it in ServerArgs.__post_init__, 0.5.23 in its resolution hooks
    check(ServerArgs(model_path=sys.argv[1], device="cpu", attention_backend="torch_native",
                     enable_deterministic_inference=True))
    print("supported")
except Exception as e:
    print(f"refused: {type(e).__name__}: {str(e).splitlines()[0]}")
"""


def probe_deterministic(engine_python: str, model_path: str) -> str:
    """SGLang's own check of `--enable-deterministic-inference` for the CPU engine's attention backend."""
    r = subprocess.run([engine_python, "-c", PROBE, model_path], capture_output=True, text=True, timeout=300,
                       cwd="/", env=dict(os.environ, SGLANG_USE_CPU_ENGINE="1"))
    lines = r.stdout.strip().splitlines()
    return lines[-1] if lines else f"probe failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}"


# ---------------------------------------------------------------- scenarios (slime's Python, real engines)
PROMPTS = ["the quick brown fox", "rollout routing replay records experts", "one two three four",
           "mixture of experts", "a b c d e f", "green eggs and ham", "to be or not to be", "hello world"]
AWAIT_S = 0.3


class BufferedSource:
    """STAND-IN for slime's RolloutDataSourceWithBuffer (its own needs a prompt file): text prompts numbered as
    slime numbers them; add_samples appends to the buffer, get_samples takes from it first."""

    def __init__(self, prompts, n):
        self.prompts, self.n, self.i, self.k, self.buffer = list(prompts), n, 0, 0, []
        self.added = []

    def get_samples(self, k):
        from slime.utils.types import Sample
        out, self.buffer = self.buffer[:k], self.buffer[k:]
        while len(out) < k and self.i < len(self.prompts):
            p = self.prompts[self.i]
            out.append([Sample(group_index=self.i, index=self.k + j, prompt=p,
                               label={"ground_truth": {"target": ["fox"]}}) for j in range(self.n)])
            self.i, self.k = self.i + 1, self.k + self.n
        return out

    def add_samples(self, groups):
        self.added.append([[(s.index, s.response_length) for s in g] for g in groups])
        self.buffer += groups


async def length_reward(args, sample):
    return float(sample.response_length)


async def awaiting_reward(args, sample):
    await asyncio.sleep(AWAIT_S)
    return float(sample.response_length)


def drop_groups_0_and_3(args, samples, **kwargs):
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    keep = samples[0].group_index not in (0, 3)
    return DynamicFilterOutput(keep=keep, reason=None if keep else "harness_drop")


OBSERVATION = " observation: a fox is a small canid. "


async def two_turns(args, sample, sampling_params):
    """A generate function in slime's style: turn, a tool observation (loss mask 0), turn; tokens from slime's
    tokenizer, posted to the router URL with slime's post."""
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.http_utils import post
    from slime.utils.types import Sample
    tok = GenerateState(args).tokenizer
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = tok(sample.prompt, add_special_tokens=False)["input_ids"]
    ids, mask, logps, text = list(prompt), [], [], ""
    for turn in range(2):
        sp = dict(sampling_params, max_new_tokens=4)
        out = await post(url, {"input_ids": ids, "sampling_params": sp, "return_logprob": True})
        meta = out["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        new = [p[1] for p in meta["output_token_logprobs"]]
        ids, mask, text = ids + new, mask + [1] * len(new), text + out["text"]
        logps += [p[0] for p in meta["output_token_logprobs"]]
        if turn == 0:
            obs = tok(OBSERVATION, add_special_tokens=False)["input_ids"]
            ids, mask, logps, text = ids + obs, mask + [0] * len(obs), logps + [0.0] * len(obs), text + OBSERVATION
    sample.tokens, sample.response_length, sample.response = ids, len(ids) - len(prompt), text
    sample.loss_mask, sample.rollout_log_probs = mask, logps
    sample.status = Sample.Status.COMPLETED
    return sample


def _search_server():
    """STAND-IN for search-r1's local retrieval server on 127.0.0.1:8000 (retrieval_server.py's answer shape)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    calls = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            calls.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"result": [[{"contents": '"Fox"\nA fox is a small canid.'}]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    srv = HTTPServer(("127.0.0.1", 8000), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, calls


# Scenarios where timing picks which over-sampled groups fill the batch, on one prompt: samples paired by order
ONE_PROMPT = {"reward that awaits"}
SCENARIOS = {   # name: (args overrides, steps, same_groups)
    "plain GRPO": (dict(rollout_batch_size=2, over_sampling_batch_size=2), 1, True),
    "over-sampling + dynamic filter": (dict(rollout_batch_size=2, over_sampling_batch_size=2,
                                            dynamic_sampling_filter_path="check_parity.drop_groups_0_and_3"), 1, True),
    "partial rollout + off-policy mask": (dict(rollout_batch_size=2, over_sampling_batch_size=4, partial_rollout=True,
                                               mask_offpolicy_in_partial_rollout=True, sglang_server_concurrency=1,
                                               custom_rm_path="check_parity.awaiting_reward"), 2, False),
    "reward that awaits": (dict(rollout_batch_size=2, over_sampling_batch_size=6,
                                custom_rm_path="check_parity.awaiting_reward"), 1, False),
    "2-turn generate function, tool observation": (dict(rollout_batch_size=2, over_sampling_batch_size=2,
                                                        custom_generate_function_path="check_parity.two_turns"), 1, True),
    "slime's search-r1 generate_with_search": (dict(rollout_batch_size=2, over_sampling_batch_size=2,
                                                    custom_generate_function_path="generate_with_search.generate",
                                                    custom_rm_path="generate_with_search.reward_func"), 1, True),
}


def run_side(which, args, overrides, steps, prompts=PROMPTS):
    """One side's outputs for `steps` rollout steps on a fresh data source of `prompts` (and the source)."""
    from slime.rollout import sglang_rollout
    from slime.rollout.sglang_rollout import GenerateState

    import rollout.slime as ours
    for k, v in overrides.items():
        setattr(args, k, v)
    GenerateState.clear_instances()   # slime's own reset of its singleton: this scenario's args
    ours.reset()
    fn = sglang_rollout.generate_rollout if which == "slime" else ours.generate_rollout
    src = BufferedSource(prompts, args.n_samples_per_prompt)
    outs = [fn(args, rid, src) for rid in range(steps)]
    return outs, src


def partial_invariants(side, outs, src) -> list:
    """Partial rollout as slime: exact batches; every group back from the buffer holds start_rollout_id 0 on its
    samples with a response and, continued, loss mask 0 on exactly the tokens it held (1 after)."""
    res = []
    held = {i: r for step in src.added[:1] for g in step for i, r in g}
    if not held:
        res.append(("DIFF", f"{side}: recycled groups", "no group went back through data_source.add_samples"))
    for rid, o in enumerate(outs):
        if len(o.samples) != 2:
            res.append(("DIFF", f"{side}: batch", f"step {rid}: {len(o.samples)} groups"))
    for s in flat(outs[1].samples):
        if s.index in held:
            k = held[s.index]
            want = [0] * k + [1] * (s.response_length - k)
            if s.loss_mask != want:
                res.append(("DIFF", f"{side}: loss_mask", f"index {s.index}: {s.loss_mask}, want {want}"))
            if k and (s.metadata or {}).get("start_rollout_id") != 0:
                res.append(("DIFF", f"{side}: start_rollout_id", f"index {s.index}: {s.metadata}"))
    cut = sum(1 for r in held.values() if 0 < r)
    print(f"[note] {side}: {len(held)} samples went back through add_samples ({cut} holding tokens: "
          f"{sorted(held.items())})", flush=True)
    res.append(("equal", f"{side}: partial rollout", None))
    return res


def held_indices(src) -> set:
    return {i for step in src.added[:1] for g in step for i, r in g}


def main(config, model_path, addrs):
    from check_against_slime import attach_slime, slime_args
    from training_configs.schema import load_config

    det = probe_deterministic(os.environ.get("ENGINE_PYTHON", sys.executable), model_path)
    print(f"[note] deterministic inference on the CPU engine: {det}; sampling is greedy (temperature 0), "
          f"slime's per-index seeds sent; logprobs compared within {LOGPROB_TOL}", flush=True)
    args = slime_args(load_config(config), model_path, addrs)
    args.rollout_temperature, args.sglang_enable_deterministic_inference = 0.0, True
    args.custom_rm_path = "check_parity.length_reward"
    attach_slime(args, addrs)
    os.environ["SLIME_MOE_ROLLOUT_CONFIG"] = config
    src = os.environ.get("SLIME_SRC") or os.path.dirname(os.path.dirname(__import__("slime").__file__))
    sys.path.insert(0, os.path.join(src, "examples", "search-r1"))
    base = dict(vars(args))
    failed = False
    search = None
    only = [x for x in os.environ.get("PARITY_SCENARIOS", "").split(",") if x]   # e.g. "plain,partial"
    chosen = {k: v for k, v in SCENARIOS.items() if not only or any(k.startswith(o) for o in only)}
    for name, (overrides, steps, same_groups) in chosen.items():
        if name.startswith("slime's search-r1"):
            search = _search_server()
        got = {}
        for which in ("slime", "ours"):
            vars(args).clear()
            vars(args).update(base)
            got[which] = run_side(which, args, dict(overrides), steps,
                                  [PROMPTS[0]] * len(PROMPTS) if name in ONE_PROMPT else PROMPTS)
        results = []
        cut = held_indices(got["slime"][1]) | held_indices(got["ours"][1])
        for a, b in zip(got["slime"][0], got["ours"][0]):
            results += compare_outputs(a, b, asked_experts=args.use_rollout_routing_replay, same_groups=same_groups,
                                       cut=cut, by_order=name in ONE_PROMPT)
        results += same_prompt_same_tokens(*got["slime"][0], *got["ours"][0])
        if name.startswith("partial"):
            for which in ("slime", "ours"):
                results += partial_invariants(which, *got[which])
        lines, bad = summarize(name, results)
        for ln in lines:
            print(ln, flush=True)
        if search is not None:
            print(f"[note] {name}: the local search stand-in was called {len(search[1])} times (the tiny random "
                  "model writes no <search> tag: one turn per sample)" if not search[1] else
                  f"[note] {name}: the local search stand-in was called {len(search[1])} times", flush=True)
            search[0].shutdown()
            search = None
        failed |= bad
    import rollout.slime as ours
    ours.reset()
    print("[FAILED] parity: an unexplained difference (above)" if failed else
          f"[ok] parity: {len(chosen)} scenario(s), every difference explained", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
