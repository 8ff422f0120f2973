"""The device check's judges: SGLang log parsing, one verdict per check from recorded inputs, the
run's budget. Pure functions (tests/test_gpu_check.py feeds them recorded inputs)."""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Optional


_GRAPH_BEGIN = re.compile(r"Capture ([\w -]+?) (?:CUDA|CPU) graph begin\..*?bs=\[([\d, ]*)\]")
_GRAPH_END = re.compile(r"Capture ([\w -]+?) (?:CUDA|CPU) graph end\.")
_FIRST_CALL = re.compile(r"(?:sgl_kernel CPU substitute|gpu-check kernels): first call of (\S+)")
WANT_GRAPHS = {"plain": ["target decode"], "nextn": ["target verify", "draft decode", "draft extend"]}


def parse_graphs(log: str) -> dict:
    """{graph name: {"bs": [...], "ended": bool}} from SGLang's capture log lines."""
    out = {}
    for m in _GRAPH_BEGIN.finditer(log):
        out[m.group(1)] = {"bs": [int(x) for x in m.group(2).replace(" ", "").split(",") if x], "ended": False}
    for m in _GRAPH_END.finditer(log):
        out.setdefault(m.group(1), {"bs": [], "ended": False})["ended"] = True
    return out


def substitute_calls(log: str) -> list:
    return sorted(set(_FIRST_CALL.findall(log)))


@dataclass
class Verdict:
    name: str
    ok: bool
    reason: str
    skip: bool = False

    def line(self) -> str:
        word = "SKIP" if self.skip else ("PASS" if self.ok else "FAIL")
        return f"gpu-check {self.name}: {word} {self.reason}"


def judge_engine_up(name: str, ready_s: Optional[float], error: Optional[str]) -> Verdict:
    if error is not None or ready_s is None:
        return Verdict(f"engine_up[{name}]", False, f"did not start: {first_error(error or 'no error text')}")
    return Verdict(f"engine_up[{name}]", True, f"/health 200 after {ready_s:.1f} s")


def first_error(text: str) -> str:
    """The line that names the failure in a log tail (the last exception line), else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|UnimplementedOp|NotImplemented)\b.*:", ln):
            return ln[-400:]
    return lines[-1][-400:] if lines else "(empty)"


def judge_graphs(name: str, kind: str, log: str) -> Verdict:
    graphs = parse_graphs(log)
    desc = "; ".join(f"{g} bs={v['bs']}{'' if v['ended'] else ' (not ended)'}" for g, v in graphs.items()) or "none"
    missing = [g for g in WANT_GRAPHS[kind] if g not in graphs or not graphs[g]["ended"] or not graphs[g]["bs"]]
    if missing:
        return Verdict(f"graphs[{name}]", False, f"not captured: {', '.join(missing)}; seen: {desc}")
    return Verdict(f"graphs[{name}]", True, desc)


def routed_mismatches(records: list, reference: dict) -> dict:
    """records: [{"seq": token ids forwarded, "routed": [[ [topk] per layer ] per token]}];
    reference: {tuple(seq): {layer: [sorted experts per token]}}. -> {"tokens", "wrong", "first"}."""
    tokens = wrong = 0
    first = None
    for i, r in enumerate(records):
        ref = reference[tuple(r["seq"])]
        if len(r["routed"]) != len(r["seq"]):
            wrong += len(r["seq"])
            first = first or f"request {i}: {len(r['routed'])} rows for {len(r['seq'])} tokens"
            continue
        for t, row in enumerate(r["routed"]):
            tokens += 1
            bad = [layer for layer, want in ref.items() if sorted(row[layer]) != want[t]]
            if bad:
                wrong += 1
                first = first or f"request {i} token {t} layer {bad[0]}: {sorted(row[bad[0]])} vs {ref[bad[0]][t]}"
    return {"tokens": tokens, "wrong": wrong, "first": first}


def judge_routed(name: str, requests: int, res: dict) -> Verdict:
    what = f"{requests} requests, {res['tokens']} tokens"
    if res["wrong"] or not res["tokens"]:
        return Verdict(f"routed_experts[{name}]", False,
                       f"{res['wrong']} of {what} differ from transformers' router (first: {res['first']})")
    return Verdict(f"routed_experts[{name}]", True, f"equal to transformers' router on all {what}")


def judge_snapshot(off: dict, on: dict) -> Verdict:
    """off/on: routed_mismatches under concurrent load without / with the capture-snapshot fix."""
    text = f"wrong rows under load: fix off {off['wrong']} of {off['tokens']}, fix on {on['wrong']} of {on['tokens']}"
    if on["wrong"]:
        return Verdict("capture_snapshot_engine", False, f"{text} (first with the fix: {on['first']})")
    if not off["wrong"]:
        return Verdict("capture_snapshot_engine", True, f"{text}: the race did not show in this engine under "
                       "this load (the fix costs nothing here; the CUDA-stream check shows the race)")
    return Verdict("capture_snapshot_engine", True, f"{text}: the race shows in a real engine and the fix removes it")


SPEED_FLOOR = 0.90  # plugin tokens/s over stock: the hooks must not cost more than 10% on a tiny model


def judge_speed(on_tps: list, off_tps: list, floor: float = SPEED_FLOOR) -> Verdict:
    """Alternating rounds on the two engines side by side; the ratio of the medians."""
    if not on_tps or not off_tps or min(off_tps) <= 0:
        return Verdict("plugin_speed", False, f"no measurement (on {on_tps}, off {off_tps})")
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    ratio = med(on_tps) / med(off_tps)
    text = (f"plugin/stock tokens/s {ratio:.3f} (median of {len(on_tps)} rounds: {med(on_tps):.0f} vs "
            f"{med(off_tps):.0f} tok/s; floor {floor})")
    return Verdict("plugin_speed", ratio >= floor, text)


def pre_retraction_tokens(chunks: list) -> Optional[int]:
    """A streamed request's chunks (cumulative `output_ids`, `meta_info.num_retractions`): the output tokens it
    had before its first retraction (the last chunk still at 0 retractions), None when never retracted."""
    before = 0
    for c in chunks:
        if int(c["meta_info"].get("num_retractions") or 0):
            return before
        before = len(c.get("output_ids") or [])
    return None


def retraction_rows(run: list, reference: list, layers: range) -> dict:
    """run: per request {"prompt": n, "output_ids", "routed": [[[topk] per layer] per row], "pre": tokens
    before its retraction or None, "rule": meta_info's routed_experts_retraction}; reference: the same
    prompts unretracted {"output_ids", "routed"}. The retracted requests' rows of the positions computed
    before the retraction, [0, prompt + pre - 1), and before the first output token that differs from the
    reference, vs the reference's rows on `layers`."""
    got = {"requests": len(run), "retracted": 0, "token_layers": 0, "differ": 0, "first": None, "rules": set()}
    for i, (o, r) in enumerate(zip(run, reference, strict=True)):
        got["rules"].add(o["rule"])
        if o["pre"] is None:
            continue
        got["retracted"] += 1
        a, b = o["output_ids"], r["output_ids"]
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        hi = o["prompt"] + max(0, min(o["pre"], same) - 1)  # row p is the forward of the token at p
        if len(o["routed"]) < hi or len(r["routed"]) < hi:
            got["differ"] += len(layers) * hi
            got["first"] = got["first"] or f"request {i}: {len(o['routed'])} rows, {len(r['routed'])} in the reference, want {hi}"
            continue
        for t in range(hi):
            got["token_layers"] += len(layers)
            bad = [ly for ly in layers if sorted(o["routed"][t][ly]) != sorted(r["routed"][t][ly])]
            got["differ"] += len(bad)
            if bad and got["first"] is None:
                got["first"] = (f"request {i} position {t} layer {bad[0]}: {sorted(o['routed'][t][bad[0]])} vs "
                                f"{sorted(r['routed'][t][bad[0]])}")
    got["rules"] = sorted(str(x) for x in got["rules"])
    return got


def judge_retraction(fix: dict, off: dict, refused: int, sampling_time: str = "sampling-time") -> Verdict:
    """fix / off: retraction_rows of the small-pool engine with the retraction fixes / with them disabled;
    refused: the disabled arm's answers the client refuses (rollout.routed_experts.retraction)."""
    name = "retraction_engine"
    text = (f"pre-retraction token-layers vs the unretracted reference: fix on {fix['differ']} of "
            f"{fix['token_layers']} differ ({fix['retracted']} of {fix['requests']} requests retracted), "
            f"disabled {off['differ']} of {off['token_layers']} ({off['retracted']} retracted, {refused} refused)")
    if not fix["retracted"] or not off["retracted"]:
        return Verdict(name, False, f"proved nothing: no request was retracted ({text})")
    if fix["rules"] != [sampling_time]:
        return Verdict(name, False, f"the fixed engine's answers state {fix['rules']}, not only {sampling_time!r}: {text}")
    if off["rules"] != ["None"]:
        return Verdict(name, False, f"the disabled engine still states a rule {off['rules']}: the fixes were not off; {text}")
    if fix["differ"] or not fix["token_layers"]:
        return Verdict(name, False, f"{text} (first with the fix: {fix['first']})")
    if not off["differ"] and not refused:  # the fixed arm's rows are right; the contrast is not shown
        return Verdict(name, False, f"{text}: the fixed arm equals the reference; the disabled arm proved nothing "
                       "(it equals the reference too, and no answer was refused)", skip=True)
    how = "differs" if off["differ"] else "is refused"
    return Verdict(name, True, f"{text}: the fixed arm equals the reference, the disabled arm {how}")


# hooked on every reviewed release: the device engine must run them
MUST_BE_ACTIVE = ("retraction-rows", "retraction-routes")


def judge_status(rc: int, out: str, logged: Optional[list]) -> Verdict:
    """`patches status` run with the engine's interpreter and environment, and the engine's own log
    line of active fixes (sglang_patches.plugin) must agree."""
    active = sorted(m.group(1) for m in re.finditer(r"^\s+(\S+)\s+\S+\s+active\b", out, re.M))
    if logged is None:
        return Verdict("patches_status", False, "the engine never logged its active fixes (plugin not loaded?)")
    if rc != 0:
        return Verdict("patches_status", False, f"rc {rc}: {out.strip().splitlines()[-1:]}")
    if active != sorted(logged):
        return Verdict("patches_status", False, f"status says active {active}, the engine logged {sorted(logged)}")
    missing = [f for f in MUST_BE_ACTIVE if f not in logged]
    if missing:
        return Verdict("patches_status", False, f"not active in the engine: {', '.join(missing)}")
    head = out.strip().splitlines()[0] if out.strip() else ""
    return Verdict("patches_status", True, f"{head}; active in the engine: {', '.join(sorted(logged)) or 'none'}")


class Budget:
    """The run's time budget: `left()`, and a progress line at most every `every` s."""

    def __init__(self, seconds: float, every: float = 20.0, clock=time.monotonic, out=sys.stdout):
        self.clock, self.out, self.every = clock, out, every
        self.start = clock()
        self.end = self.start + seconds
        self._last = -every

    def left(self) -> float:
        return self.end - self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def tick(self, what: str) -> None:
        if self.elapsed() - self._last >= self.every:
            self._last = self.elapsed()
            print(f"  ... {what}: {self.elapsed():.0f} s of {self.end - self.start:.0f} s", file=self.out, flush=True)
