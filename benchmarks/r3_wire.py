"""Routed experts on the wire at GLM-4.5's shape (92 layers, 3 dense, top-8 of 160): SGLang's int32 vs the
plugin's compact format (`compact-routed-experts`), synthetic payloads of the real layout.

  wire bytes     base64 bytes per token in meta_info["routed_experts"], compact / int32 (3,925 B): a constant
                 of the layout, printed as a fact.
  engine_encode  the engine's per-request work: compact = scheduler `encode` + the detokenizer's own
                 `_b64_encode_per_request` + the tokenizer hop's header split + orjson of the meta_info;
                 int32 = the detokenizer's `_b64_encode_per_request` + orjson. Real SGLang functions.
  client_decode  the client's work per answer: json.loads(body) + decode. Ours: `sample_routed_experts`
                 (layout, rows, ids in range, no repeated id, no missing routing) -> uint8 [T-1, 89, 8];
                 slime's: b64decode -> torch.frombuffer(int32) -> reshape [T-1, 92, 8] (no checks).
  step_memory    peak host memory of one rollout step's routed experts (--samples x --tokens, answers
                 arriving one at a time, every sample's array held), each arm in its own process (peak RSS
                 since a reset of VmHWM, over its RSS then): ours on the compact wire vs slime's path on int32;
                 slime's plugin mode (compact wire, converted to slime's int32 once per sample) as a fact.
Runs alternate a, b, a, b, ...; time ratios are medians of b/a over pairs.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import orjson  # noqa: E402
import torch  # noqa: E402

from _targets import fact, finish, judge  # noqa: E402
from routed_experts import GLM45, slime_path  # noqa: E402
from rollout.routed_experts import MoELayout, encode_sglang, sample_routed_experts, to_slime_shape, wire_layout  # noqa: E402
from _synthetic import synthetic_full  # noqa: E402
from sglang_patches.features import routed_experts_wire as wire  # noqa: E402

LAYOUT = MoELayout.from_hf_config(GLM45)


def b64_per_request(tensors):
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    return DetokenizerManager._b64_encode_per_request(tensors)


def engine_int32(full_t):
    s = b64_per_request([full_t])[0]
    return orjson.dumps({"meta_info": {"routed_experts": s}})


def engine_compact(full_t):
    t = wire.encode(full_t, wire_layout(LAYOUT), 0)
    layout, body = wire.split_b64(b64_per_request([t])[0])
    return orjson.dumps({"meta_info": {"routed_experts": body, wire.LAYOUT_KEY: layout}})


def client_slime(body, T):
    return slime_path(json.loads(body)["meta_info"]["routed_experts"], LAYOUT)


def client_ours(body, T):
    arr, why = sample_routed_experts(json.loads(body)["meta_info"], T, LAYOUT)
    assert why is None, why
    return arr


def client_adapter(body, T):
    """slime's plugin mode: compact until handed to slime, then slime's int32 shape once."""
    return to_slime_shape(client_ours(body, T), LAYOUT)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def hwm_mib() -> float:
    """Peak RSS since the last reset (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def step_child(arm: str, body_path: str, samples: int, tokens: int) -> None:
    """One arm's rollout step in this process, on the answer body at `body_path`: prints its peak RSS over
    the baseline (imports and the template body loaded) and what it holds."""
    with open(body_path, "rb") as f:
        template = f.read()
    client = {"ours": client_ours, "slime": client_slime, "adapter": client_adapter}[arm]
    client(bytes(bytearray(template)), tokens)   # warm (lazy imports), then dropped
    with open("/proc/self/clear_refs", "w") as f:   # reset the peak (VmHWM) to the current RSS
        f.write("5")
    base = rss_mib()
    held = []
    for _ in range(samples):
        body = bytes(bytearray(template))   # a fresh answer body, as received
        held.append(client(body, tokens))
        del body
    peak = hwm_mib() - base
    print(json.dumps({"peak_mib": peak, "held_mib": sum(x.nbytes if hasattr(x, "nbytes") else
                                                        x.numel() * x.element_size() for x in held) / 2**20}))


def step_peak(arm: str, body: bytes, samples: int, tokens: int) -> dict:
    with tempfile.NamedTemporaryFile(prefix=f"r3-wire-{arm}-", suffix=".json") as f:
        f.write(body)
        f.flush()
        p = subprocess.run([sys.executable, __file__, "--step-child", arm, f.name, "--samples", str(samples),
                            "--tokens", str(tokens)], capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(f"error: step_memory child ({arm}) failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per sample (default 4096)")
    p.add_argument("--runs", type=int, default=9, help="alternating (a, b) pairs (default 9)")
    p.add_argument("--samples", type=int, default=128, help="samples in the memory step (default 128)")
    p.add_argument("--step-child", nargs=2, metavar=("ARM", "BODY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens < 2 or args.runs < 1 or args.samples < 1:
        p.error("--tokens must be >= 2, --runs and --samples >= 1")
    if args.step_child:
        return step_child(*args.step_child, args.samples, args.tokens)

    T = args.tokens
    full = synthetic_full(T - 1, LAYOUT, seed=0)
    full_t = torch.from_numpy(full)
    print(f"GLM-4.5 shape: {LAYOUT.num_hidden_layers} layers ({len(LAYOUT.dense_layers)} dense), "
          f"{LAYOUT.num_experts} experts, top-{LAYOUT.topk}; one {T}-token answer")

    body_a, body_b = engine_int32(full_t), engine_compact(full_t)
    s_a = json.loads(body_a)["meta_info"]["routed_experts"]
    s_b = json.loads(body_b)["meta_info"]["routed_experts"]
    assert s_a == encode_sglang(full)   # SGLang's own format, byte for byte
    bpt_a, bpt_b = len(s_a) / (T - 1), len(s_b) / (T - 1)
    print(f"wire: int32 {bpt_a:.1f} B/token, compact {bpt_b:.1f} B/token (HTTP body {len(body_a) / (T - 1):.1f} "
          f"vs {len(body_b) / (T - 1):.1f}); information limit log2 C(160, 8) x 89 / 8 = 482 B/token")
    fact("r3_wire", f"wire bytes per token, compact / int32: {bpt_b:.0f} / {bpt_a:.0f} = {bpt_b / bpt_a:.3f} "
                    "(a constant of the layout)")

    ea, eb, er, ca, cb, cr = [], [], [], [], [], []
    for _ in range(args.runs):
        a, _ = timed(engine_int32, full_t)
        b, _ = timed(engine_compact, full_t)
        ea.append(a), eb.append(b), er.append(b / a)
        a, held_a = timed(client_slime, body_a, T)
        b, held_b = timed(client_ours, body_b, T)
        ca.append(a), cb.append(b), cr.append(b / a)
    assert np.array_equal(held_a.numpy()[:, 3:], held_b)
    us = lambda xs: statistics.median(xs) / (T - 1) * 1e6  # noqa: E731
    print(f"engine per token: int32 {us(ea):.2f} us, compact {us(eb):.2f} us")
    judge("r3_wire", "engine_encode", statistics.median(er))
    print(f"client per token: slime (json + b64decode + frombuffer) {us(ca):.2f} us, ours (json + decode + "
          f"validate) {us(cb):.2f} us")
    judge("r3_wire", "client_decode", statistics.median(cr))

    pa, pb = step_peak("slime", body_a, args.samples, T), step_peak("ours", body_b, args.samples, T)
    print(f"one rollout step, {args.samples} samples x {T} tokens: peak host memory slime {pa['peak_mib']:.0f} MiB "
          f"(held {pa['held_mib']:.0f}), ours {pb['peak_mib']:.0f} MiB (held {pb['held_mib']:.0f})")
    fact("r3_wire", f"held per token: slime {LAYOUT.num_hidden_layers * LAYOUT.topk * 4} B, ours "
         f"{LAYOUT.num_moe_layers * LAYOUT.topk} B: at 4,096 samples x 4k tokens "
         f"{4096 * 4095 * LAYOUT.num_hidden_layers * LAYOUT.topk * 4 / 2**30:.1f} vs "
         f"{4096 * 4095 * LAYOUT.num_moe_layers * LAYOUT.topk / 2**30:.1f} GiB")
    judge("r3_wire", "step_memory", pb["peak_mib"] / pa["peak_mib"])
    pc = step_peak("adapter", body_b, args.samples, T)
    fact("r3_wire", f"slime plugin mode (compact wire, slime's int32 handed over per sample): peak "
         f"{pc['peak_mib']:.0f} MiB = {pc['peak_mib'] / pa['peak_mib']:.2f}x slime's path (its trainer holds int32)")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
