"""The device check's logic that needs no GPU: carry list, install plan, engine commands, judges.

Used by scripts/gpu_check/engine_checks.py on the device and by tests/test_gpu_check.py (the CPU dry
run). Importing it imports neither torch nor SGLang (`resolved` imports SGLang when called).
    python scripts/gpu_check/plan.py check-carry [WHEEL_DIR]    # each carried wheel there, sizes, <= 64 MiB
    python scripts/gpu_check/plan.py resolve MODEL              # each engine's ServerArgs, resolved by SGLang
    python scripts/gpu_check/plan.py install WHEEL_DIR SITE LOG # on the device (run.sh)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
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


# The retraction check's engines: a KV pool too small for RETRACT_REQUESTS requests of RETRACT_NEW tokens
# (prompts of 5-40 tokens), every request admitted at once (a low schedule_conservativeness: SGLang reserves
# little for future tokens), so the pool runs full while they decode and SGLang retracts some.
RETRACT_POOL, RETRACT_REQUESTS, RETRACT_NEW = 512, 16, 64
RETRACT_FIELDS = {"max_total_tokens": RETRACT_POOL, "max_running_requests": RETRACT_REQUESTS,
                  "schedule_conservativeness": 0.1}
RETRACTION_FIXES = "retraction-rows,retraction-routes"


@dataclass
class EngineSpec:
    """One engine of the check: `kind` plain or nextn; env on top of the device's; ServerArgs fields over
    engine_fields'."""
    name: str
    kind: str = "plain"
    env: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)


def engine_specs() -> list:
    """plugin on; plugin without capture-snapshot; no plugin (SGLANG_PLUGINS=none); NEXTN with the plugin;
    the retraction check's small-pool engines, the plugin with and without the retraction fixes (the
    reference, nobody retracted, is `plugin`)."""
    return [EngineSpec("plugin"), EngineSpec("no-snapshot", env={"SLIME_MOE_ROLLOUT_DISABLE": "capture-snapshot"}),
            EngineSpec("no-plugin", env={"SGLANG_PLUGINS": "none"}), EngineSpec("nextn", kind="nextn"),
            EngineSpec("retract", fields=dict(RETRACT_FIELDS)),
            EngineSpec("retract-off", env={"SLIME_MOE_ROLLOUT_DISABLE": RETRACTION_FIXES}, fields=dict(RETRACT_FIELDS))]


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

    return cmd.build(spec.name, {**engine_fields(model_path, spec.kind), **spec.fields}, device="cuda", port=port,
                     api_key=api_key, env={**ENGINE_ENV, **spec.env})


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
            "speculative": sa.speculative_algorithm, "draft_model": sa.speculative_draft_model_path,
            "max_total_tokens": sa.max_total_tokens, "max_running_requests": sa.max_running_requests,
            "schedule_conservativeness": sa.schedule_conservativeness}


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
    print("usage:\n" + "\n".join(ln for ln in __doc__.splitlines() if "plan.py" in ln), file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (PlanError, OSError, subprocess.CalledProcessError) as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        sys.exit(2)
