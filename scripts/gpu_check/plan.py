"""The device check's logic that needs no GPU: carry list, install plan, engine commands, judges.

Used by scripts/gpu_check/engine_checks.py on the device and by tests/test_gpu_check.py (the CPU dry
run). Nothing here imports torch or SGLang.
    python scripts/gpu_check/plan.py check-carry [WHEEL_DIR]   # every carried wheel there, sizes, <= 64 MiB
    python scripts/gpu_check/plan.py resolve MODEL                   # each engine's ServerArgs, resolved by SGLang
    python scripts/gpu_check/plan.py install WHEEL_DIR SITE LOG      # on the device (run.sh)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
CARRY_LIST = Path(__file__).with_name("wheels.txt")
CARRY_LIMIT = 64 << 20  # the device tool's limit: working tree + carried paths, per call
WHEEL_DIR = ".gpu"
# Tags the device's Python 3.12 (x86-64, glibc) installs.
_TAGS = re.compile(r"-(cp312-cp312|cp312-abi3|cp3\d+-abi3|py3-none|py2\.py3-none)-(manylinux\S*x86_64|any)\.whl$")


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version
    filename: str
    size: int

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0].lower().replace("_", "-")


def read_carry(path: Path = CARRY_LIST) -> list:
    """The carry list: `name==version  filename  bytes` per line (# comments)."""
    out, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or "==" not in parts[0] or not parts[2].isdigit():
            raise PlanError(f"{path}:{n}: want 'name==version filename bytes', got {line!r}")
        w = Wheel(parts[0], parts[1], int(parts[2]))
        if not _TAGS.search(w.filename):
            raise PlanError(f"{path}:{n}: {w.filename} is not a cp312 / abi3 / pure-Python x86-64 wheel")
        if w.name in seen:
            raise PlanError(f"{path}:{n}: {w.name} listed twice (two versions stop the install)")
        seen.add(w.name)
        out.append(w)
    return out


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels besides the carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def check_carry(wheels: list, wheel_dir: Optional[Path] = None, tree: int = 0, limit: int = CARRY_LIMIT) -> list:
    """Problems (one line each): a wheel missing or of another size in `wheel_dir`, a file there that
    is not listed, or the total over `limit`. Empty when the carry fits."""
    problems = []
    if wheel_dir is not None:
        wheel_dir = Path(wheel_dir)
        for w in wheels:
            f = wheel_dir / w.filename
            if not f.is_file():
                problems.append(f"{f}: missing (run scripts/gpu_check/fetch_wheels.sh)")
            elif f.stat().st_size != w.size:
                problems.append(f"{f}: {f.stat().st_size} bytes, the carry list says {w.size}")
        listed = {w.filename for w in wheels}
        problems += [f"{p}: not in {CARRY_LIST.name} (it would travel and be installed)"
                     for p in sorted(wheel_dir.glob("*.whl")) if p.name not in listed]
    total = tree + sum(w.size for w in wheels)
    if total > limit:
        problems.append(f"carry {mib(total)} (tree {mib(tree)} + wheels) is over the {mib(limit)} limit")
    return problems


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def install_argv(python: str, wheel_dir: str, site: str, wheels: list) -> list:
    """pip's offline install of exactly the listed wheels into `site` (SGLang with --no-deps)."""
    return [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", site] + [os.path.join(wheel_dir, w.filename) for w in wheels]


def install(wheel_dir: str, site: str, log: str, wheels: Optional[list] = None, python: str = sys.executable) -> str:
    """Install the carried wheels (missing or resized ones refused first); if pip refuses (a platform
    tag), unpack the same wheels into `site`. Returns how it was done; raises PlanError."""
    wheels = read_carry() if wheels is None else wheels
    bad = [p for p in check_carry(wheels, Path(wheel_dir), limit=1 << 62) if "not in" not in p]
    if bad:
        raise PlanError("; ".join(bad))
    with open(log, "w") as fh:
        rc = subprocess.run(install_argv(python, wheel_dir, site, wheels), stdout=fh, stderr=subprocess.STDOUT).returncode
    how = f"pip installed {len(wheels)} wheels"
    if rc != 0:
        import zipfile

        for w in wheels:
            with zipfile.ZipFile(os.path.join(wheel_dir, w.filename)) as z:
                z.extractall(site)
        how = f"pip refused (rc {rc}, {log}); unpacked {len(wheels)} wheels"
    register_entry_point(site)
    return how + "; this checkout's plugin entry point registered"


def register_entry_point(site: str) -> None:
    """A dist-info for this checkout in `site`, so SGLang's load_plugins() finds our entry point (as pip would)."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    d = Path(site) / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    eps = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items())
                  for group, entries in meta["entry-points"].items())
    (d / "entry_points.txt").write_text(eps)


# ------------------------------------------------------------------ engines

GRAPH_BS = [1, 2, 4, 8, 16]
NEXTN = {"algorithm": "NEXTN", "num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3}


@dataclass
class EngineSpec:
    """One engine of the check: `kind` plain or nextn; env on top of the device's."""
    name: str
    kind: str = "plain"
    env: dict = field(default_factory=dict)


def engine_specs() -> list:
    """plugin on; plugin without capture-snapshot; no plugin (SGLANG_PLUGINS=none); NEXTN with the plugin."""
    return [EngineSpec("plugin"), EngineSpec("no-snapshot", env={"SLIME_MOE_ROLLOUT_DISABLE": "capture-snapshot"}),
            EngineSpec("no-plugin", env={"SGLANG_PLUGINS": "none"}), EngineSpec("nextn", kind="nextn")]


def engine_fields(model_path: str, kind: str = "plain") -> dict:
    """ServerArgs fields (SGLang 0.5.15.post1) of a tp-1 CUDA engine: Triton attention (no kernel
    wheel), decode CUDA graphs on (no prefill graphs: they need torch.compile), overlap scheduling
    on (SGLang's default), routed experts on, PyTorch sampling (no flashinfer)."""
    if kind not in ("plain", "nextn"):
        raise PlanError(f"unknown engine kind {kind!r} (plain or nextn)")
    f = {"model_path": model_path, "tp_size": 1, "attention_backend": "triton", "sampling_backend": "pytorch",
         "mem_fraction_static": 0.08, "max_total_tokens": 16384, "cuda_graph_bs_decode": list(GRAPH_BS),
         "disable_prefill_cuda_graph": True, "enable_return_routed_experts": True, "log_level": "info"}
    if kind == "nextn":
        f.update(speculative_algorithm=NEXTN["algorithm"], speculative_num_steps=NEXTN["num_steps"],
                 speculative_eagle_topk=NEXTN["eagle_topk"], speculative_num_draft_tokens=NEXTN["num_draft_tokens"])
    return f


ENGINE_ENV = {
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",  # no sglang-kernel distribution: the substitute serves it
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
    "SGL_KERNEL_CPU_TRACE": "1",  # the substitute names each op on its first call (the log shows what ran)
}


def engine_command(spec: EngineSpec, model_path: str, port: int, api_key: str):
    """The one command builder's NodeCommand (rollout.engines.command, device profile cuda)."""
    from rollout.engines import command as cmd

    return cmd.build(spec.name, engine_fields(model_path, spec.kind), device="cuda", port=port, api_key=api_key,
                     env={**ENGINE_ENV, **spec.env})


def resolved(argv: list) -> dict:
    """The engine's argv through SGLang's own parser and ServerArgs resolution (no GPU needed): the
    facts the checks rely on."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    i = argv.index("sglang.launch_server") + 1
    sa = ServerArgs.from_cli_args(p.parse_args(argv[i:]))
    g = sa.cuda_graph_config
    return {"device": sa.device, "tp_size": sa.tp_size, "attention_backend": sa.attention_backend,
            "overlap_schedule": not sa.disable_overlap_schedule, "decode_graph": g.decode.backend,
            "decode_bs": list(g.decode.bs), "prefill_graph": g.prefill.backend,
            "routed_experts": sa.enable_return_routed_experts, "sampling_backend": sa.sampling_backend,
            "speculative": sa.speculative_algorithm, "draft_model": sa.speculative_draft_model_path}


# ------------------------------------------------------------------ log parsing and judges

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


def main(argv: list) -> int:
    if argv[:1] == ["check-carry"]:
        wheels = read_carry()
        d = Path(argv[1]) if len(argv) > 1 else ROOT / WHEEL_DIR
        tree = tree_bytes()
        problems = check_carry(wheels, d, tree)
        for p in problems:
            print(f"gpu-check carry: {p}", file=sys.stderr)
        total = tree + sum(w.size for w in wheels)
        print(f"gpu-check carry: {len(wheels)} wheels {mib(total - tree)} + tree {mib(tree)} = {mib(total)} "
              f"of {mib(CARRY_LIMIT)}: {'FAIL' if problems else 'ok'}")
        return 1 if problems else 0
    if argv[:1] == ["resolve"] and len(argv) == 2:  # each engine's resolved ServerArgs facts, as JSON
        import json

        for spec in engine_specs():
            c = engine_command(spec, argv[1], 30000, "(key)")
            print(json.dumps({"name": spec.name, "env": c.env, "argv": c.argv[1:], "resolved": resolved(c.argv)}))
        return 0
    if argv[:1] == ["install"] and len(argv) == 4:
        print(f"gpu-check install: {install(argv[1], argv[2], argv[3])}", flush=True)
        return 0
    print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (PlanError, OSError) as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        sys.exit(2)
