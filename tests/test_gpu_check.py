"""CPU dry run of the device check (scripts/gpu_check/): everything it does that needs no CUDA.

The carry list fits the device tool's 64 MiB with the tree; the install plan installs exactly the
listed wheels (a real offline pip install of a wheel built here, and the unpack fallback); in a fresh
interpreter of SGLang 0.5.15.post1's environment the kernel shim serves `sgl_kernel`, flashinfer
stand-ins and the torch JIT-kernel ops, and the engine's modules import on SGLang's CUDA branches (torch
claiming a GPU, mocked); those ops equal SGLang's own native code on CPU tensors; every engine command resolves through SGLang's own ServerArgs to the configuration the
checks assume; the judges give the right verdicts and reasons on recorded inputs. No engine starts.
"""
import ast
import json
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from support import ROOT
from support.variant_runs import python_of

GPU = ROOT / "scripts" / "gpu_check"
sys.path.append(str(GPU))  # plan, judges, engine_checks, ops_check
import judges  # noqa: E402
import plan  # noqa: E402

pytestmark = pytest.mark.timeout(240)
V15 = "0.5.15.post1"


def _site_packages(py: Path) -> Path:
    """The environment's own site-packages (scripts/setup_sglang_env.sh installs SGLang there)."""
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    sp = Path(out.stdout.strip())
    assert (sp / "sglang" / "version.py").is_file(), sp
    return sp


# ---------------------------------------------------------------- carry list and install plan

def test_carry_list_fits_the_device_limit():
    wheels = plan.read_carry()
    names = {w.name for w in wheels}
    assert {"sglang", "transformers", "tokenizers", "apache-tvm-ffi", "megatron-core"} <= names
    pins = [ln for ln in (ROOT / "requirements" / f"sglang-{V15}.txt").read_text().splitlines() if "==" in ln]
    assert set(pins) <= {w.requirement for w in wheels}, "the carried pins differ from the reviewed environment's"
    assert "cp312" in next(w for w in wheels if w.name == "sglang").filename
    tree = plan.tree_bytes()
    assert plan.check_carry(wheels, None, tree) == [], "the carry list and the tree exceed 64 MiB"
    total = tree + sum(w.size for w in wheels)
    assert total < plan.CARRY_LIMIT - (4 << 20), f"{plan.mib(total)}: under 4 MiB of headroom left"
    if (ROOT / plan.WHEEL_DIR).is_dir():  # fetched here (scripts/gpu_check/fetch_wheels.sh): exactly these
        assert plan.check_carry(wheels, ROOT / plan.WHEEL_DIR, tree) == []


def test_carry_list_bad_input_names_the_problem(tmp_path):
    bad = tmp_path / "wheels.txt"
    for text, needle in (("sglang 0.5.15 x.whl 12\n", "want 'name==version filename bytes'"),
                         ("a==1 a-1-cp311-cp311-manylinux_2_17_x86_64.whl 10\n", "not a cp312 / abi3 / pure-Python"),
                         ("a==1 a-1-py3-none-any.whl 1\na==2 a-2-py3-none-any.whl 1\n", "a listed twice")):
        bad.write_text(text)
        with pytest.raises(plan.PlanError, match=needle):
            plan.read_carry(bad)
    r = subprocess.run([sys.executable, str(GPU / "plan.py"), "install", str(tmp_path), str(tmp_path / "s"),
                        str(tmp_path / "log")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing (run scripts/gpu_check/fetch_wheels.sh)" in r.stderr


def test_check_carry_reports_missing_resized_unlisted_and_over_limit(tmp_path):
    w = [plan.Wheel("a==1", "a-1-py3-none-any.whl", 10), plan.Wheel("b==1", "b-1-py3-none-any.whl", 5)]
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"x" * 9)
    (tmp_path / "c-1-py3-none-any.whl").write_bytes(b"x")
    problems = plan.check_carry(w, tmp_path, tree=100, limit=110)
    assert any("a-1-py3-none-any.whl: 9 bytes, the carry list says 10" in p for p in problems)
    assert any("b-1-py3-none-any.whl: missing" in p for p in problems)
    assert any("c-1-py3-none-any.whl: not in wheels.txt" in p for p in problems)
    assert any("is over the 0.0 MiB limit" in p for p in problems)


def _wheel(d: Path, name: str) -> plan.Wheel:
    f = d / f"{name}-1.0-py3-none-any.whl"
    di = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(f, "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    return plan.Wheel(f"{name}==1.0", f.name, f.stat().st_size)


def test_install_plan_installs_exactly_the_listed_wheels_offline(tmp_path):
    wd, site = tmp_path / "wheels", tmp_path / "site"
    wd.mkdir()
    wheels = [_wheel(wd, "gpucheckdemo")]
    argv = plan.install_argv(sys.executable, str(wd), str(site), wheels)
    assert argv[:3] == [sys.executable, "-m", "pip"] and {"--no-index", "--no-deps", "--target"} <= set(argv)
    assert argv[-1] == str(wd / wheels[0].filename)
    how = plan.install(str(wd), str(site), str(tmp_path / "pip.log"), wheels)
    assert how.startswith("pip installed 1 wheels"), how
    assert (site / "gpucheckdemo" / "__init__.py").read_text() == "VALUE = 42\n"
    eps = (site / "slime_moe_rollout-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[sglang.srt.plugins]\nslime_moe_rollout = sglang_patches.plugin:register" in eps
    # pip refusing (as for a platform tag): the same wheels are unpacked instead
    how = plan.install(str(wd), str(tmp_path / "site2"), str(tmp_path / "pip2.log"), wheels, python="/bin/false")
    assert how.startswith("pip refused (rc 1") and (tmp_path / "site2" / "gpucheckdemo" / "__init__.py").exists()


def test_run_sh_bad_arguments_exit_2():
    for env, args, needle in (({}, ["bogus"], "usage:"), ({"GPU_CHECK_KERNELS": "cuda"}, [], "GPU_CHECK_KERNELS=cuda")):
        r = subprocess.run(["bash", str(GPU / "run.sh"), *args], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 2 and needle in r.stderr, (r.stdout, r.stderr)


# ---------------------------------------------------------------- kernel shim and ops

_SHIM_PROBE = r"""
import importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
assert "gpu_check_kernel_shim" in sys.modules, "sitecustomize did not load the shim"
import cuda_imports
out = {"imports": cuda_imports.run()}  # the engine's modules on SGLang's CUDA branches (torch claims a GPU)
import torch
import sgl_kernel
from sgl_kernel.utils import is_arch_support_pdl
from sglang_patches.cpu.sgl_kernel_cpu import cuda_ops
from flashinfer.sampling import min_p_sampling_from_probs
out.update(substitute=getattr(sgl_kernel, "IS_CPU_SUBSTITUTE", False), pdl=is_arch_support_pdl(),
           flashinfer_spec=importlib.util.find_spec("flashinfer") is not None)
try:
    min_p_sampling_from_probs(None)
except NotImplementedError as e:
    out["standin"] = str(e)
out["sgl_ops"] = sorted(n for n in cuda_ops.OPS if getattr(getattr(sgl_kernel, n), "__name__", "") == n)
x = torch.randn(3, 8)
out["sgl_rmsnorm"] = torch.equal(sgl_kernel.rmsnorm(x, torch.ones(8), 1e-6), cuda_ops.rmsnorm(x, torch.ones(8), 1e-6))
jit = {}
for mod, table in cuda_ops.JIT_OPS.items():
    m = __import__(mod, fromlist=["_"])
    jit[mod] = {n: getattr(getattr(m, n), "__wrapped__", None) is fn for n, fn in table.items()}
out["jit"] = jit
import sglang.jit_kernel.activation as act
act.silu_and_mul(torch.randn(2, 8))
print(json.dumps(out))
"""


def _shim_env(tmp_path, kernels=None) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    shutil.copy(GPU / "sitecustomize.py", site / "sitecustomize.py")
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}", "GPU_CHECK_SHIM": str(GPU / "kernel_shim.py")}
    env.pop("GPU_CHECK_KERNELS", None)
    if kernels:
        env["GPU_CHECK_KERNELS"] = kernels
    return env


def test_kernel_shim_serves_the_engine_modules_on_sglang_cuda_branches(tmp_path):
    """In a fresh 0.5.15.post1 interpreter with the device's sitecustomize: with torch claiming CUDA
    (mocked), every module an engine of the check imports, imports, and the plugin registers its fixes;
    `sgl_kernel` is the substitute with the CUDA ops, flashinfer's submodules are stand-ins, SGLang's
    JIT-kernel functions are the torch ops and name themselves on their first call."""
    py = python_of(V15)
    r = subprocess.run([str(py), "-c", _SHIM_PROBE, str(GPU)], env=_shim_env(tmp_path), cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    from sglang_patches.cpu.sgl_kernel_cpu import cuda_ops

    assert out["imports"]["ok"], out["imports"]["failed"]
    registered = out["imports"]["registered"]
    assert "capture-snapshot" in registered and not [f for f in registered if f.startswith("cpu-")]
    assert out["substitute"] and out["pdl"] is False and out["flashinfer_spec"] is False
    assert "flashinfer.sampling.min_p_sampling_from_probs is not available" in out["standin"]
    assert out["sgl_ops"] == sorted(cuda_ops.OPS) and out["sgl_rmsnorm"]
    assert out["jit"] == {m: {n: True for n in t} for m, t in cuda_ops.JIT_OPS.items()}
    assert "gpu-check kernels: first call of sglang.jit_kernel.activation.silu_and_mul" in r.stderr


def test_kernel_shim_jit_mode_and_an_image_sitecustomize(tmp_path):
    """GPU_CHECK_KERNELS=jit leaves SGLang's own JIT kernels; an image's own sitecustomize still runs."""
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text("import os\nos.environ['IMAGE_SITECUSTOMIZE'] = 'ran'\n")
    env = _shim_env(tmp_path, "jit")
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(":", f":{image}:", 1)
    probe = "import os, sys; print(sorted(type(f).__name__ for f in sys.meta_path), os.environ.get('IMAGE_SITECUSTOMIZE'))"
    r = subprocess.run([str(python_of(V15)), "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'StandInFinder'" in r.stdout and "JitFinder" not in r.stdout and r.stdout.strip().endswith("ran"), r.stdout


def test_cuda_import_probe_reports_the_first_gap(tmp_path):
    r = subprocess.run([sys.executable, str(GPU / "cuda_imports.py"), "json", "gpu_check_no_such_module", "os"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert not res["ok"] and res["imported"] == ["json"] and res["registered"] is None
    assert res["failed"].startswith("gpu_check_no_such_module: ModuleNotFoundError: No module named"), res


def test_substituted_names_are_sglang_0_5_15_names():
    """Every torch op replaces a name SGLang 0.5.15.post1 really imports: sgl_kernel names from its
    source, jit_kernel functions that its modules define (a typo would leave the real kernel in use)."""
    from sglang_patches.cpu.sgl_kernel_cpu import cuda_ops

    sp = _site_packages(python_of(V15))
    imported = set()
    for f in (sp / "sglang" / "srt").rglob("*.py"):
        text = f.read_text(encoding="utf-8-sig", errors="replace")
        if "sgl_kernel" not in text:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SGLang sources with invalid escapes
            tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sgl_kernel"):
                imported |= {a.name for a in node.names}
    assert set(cuda_ops.OPS) - imported == set()
    for mod, table in cuda_ops.JIT_OPS.items():
        src = (sp / (mod.replace(".", "/") + ".py")).read_text()
        defined = {n.name for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
        assert set(table) - defined == set(), mod


def test_cuda_ops_equal_sglang_native_on_cpu_tensors():
    r = subprocess.run([str(python_of(V15)), str(GPU / "ops_check.py"), "cpu"], cwd=ROOT, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rope(neox=True)", "moe_align_block_size",
            "topk_sigmoid"} <= set(res)
    assert {k: v for k, v in res.items() if not v["ok"]} == {}


def test_moe_align_contract_catches_a_wrong_layout():
    """The contract check itself: a substitute that drops the -1 bucket fails it."""
    from ops_check import _align_contract
    from sglang_patches.cpu.sgl_kernel_cpu import cuda_ops

    class Broken:
        @staticmethod
        def moe_align_block_size(topk_ids, *a):
            cuda_ops.moe_align_block_size(topk_ids.clamp(min=0), *a)

    assert _align_contract(cuda_ops, "cpu")[0]
    ok, detail = _align_contract(Broken, "cpu")
    assert not ok and "misplaced" in detail, detail


# ---------------------------------------------------------------- engine commands

def test_engine_commands_resolve_through_sglang_server_args(tmp_path):
    from rollout.models.tiny import build_tiny_glm

    model = build_tiny_glm(str(tmp_path / "tiny"), variant="random")
    r = subprocess.run([str(python_of(V15)), str(GPU / "plan.py"), "resolve", model], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {d["name"]: d for d in map(json.loads, r.stdout.strip().splitlines())}
    assert list(rows) == ["plugin", "no-snapshot", "no-plugin", "nextn", "retract", "retract-off"]
    for name, d in rows.items():
        res = d["resolved"]
        assert res["device"] == "cuda" and res["tp_size"] == 1 and res["attention_backend"] == "triton"
        assert res["overlap_schedule"] and res["routed_experts"] and res["sampling_backend"] == "pytorch"
        assert res["decode_graph"] == "full" and res["decode_bs"] == plan.GRAPH_BS and res["prefill_graph"] == "disabled"
        assert res["speculative"] == ("EAGLE" if name == "nextn" else None)  # SGLang resolves NEXTN to EAGLE
        assert "--api-key" not in d["argv"] and d["env"]["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] == "1"
    assert rows["nextn"]["resolved"]["draft_model"] == model
    assert rows["no-plugin"]["env"]["SGLANG_PLUGINS"] == "none"
    assert rows["no-snapshot"]["env"]["SLIME_MOE_ROLLOUT_DISABLE"] == "capture-snapshot"
    assert "SGLANG_PLUGINS" not in rows["plugin"]["env"]
    # the retraction check: both small-pool engines differ from the reference only in the pool's admission
    # fields, and the disabled one only in the two fixes
    for name in ("retract", "retract-off"):
        res = rows[name]["resolved"]
        assert (res["max_total_tokens"], res["max_running_requests"], res["schedule_conservativeness"]) == \
            (plan.RETRACT_POOL, plan.RETRACT_REQUESTS, 0.1)
        assert {k: v for k, v in res.items() if k not in plan.RETRACT_FIELDS} == \
            {k: v for k, v in rows["plugin"]["resolved"].items() if k not in plan.RETRACT_FIELDS}
    assert rows["plugin"]["resolved"]["max_total_tokens"] > plan.RETRACT_REQUESTS * (40 + plan.RETRACT_NEW)
    assert plan.RETRACT_POOL < plan.RETRACT_REQUESTS * (5 + plan.RETRACT_NEW)  # even the shortest prompts overflow it
    assert rows["retract-off"]["env"]["SLIME_MOE_ROLLOUT_DISABLE"] == "retraction-rows,retraction-routes"
    assert "SLIME_MOE_ROLLOUT_DISABLE" not in rows["retract"]["env"]


def test_engine_checks_cli_parses_without_cuda():
    r = subprocess.run([sys.executable, str(GPU / "engine_checks.py"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--budget" in r.stdout and "--requests" in r.stdout
    r = subprocess.run([sys.executable, str(GPU / "engine_checks.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--work" in r.stderr


@pytest.mark.e2e   # ~35 s on the pooled engine; the check's judging and commands are tested above in make test
def test_retraction_check_runs_against_a_real_cpu_engine(engine_pool, tiny_model, capsys):
    """engine_checks.check_retraction end to end against the real SGLang CPU engine of preset (a) (the pool's,
    shared with the engine tests) in all three roles, 3 requests of 8 tokens: streamed answers parsed, rows
    decoded and compared, the client's refusal asked. Its pool holds them all, so nobody is retracted and
    the verdict is the one that says so (on the device two small-pool engines retract)."""
    import engine_checks
    from support.engines import preset

    eng = engine_pool.get("a", preset("a", tiny_model))
    engine_checks.RESULTS.clear()
    engine_checks.check_retraction({"plugin": eng, "retract": eng, "retract-off": eng}, n_req=3, new=8)
    (v,) = engine_checks.RESULTS
    assert v.name == "retraction_engine" and not v.ok and not v.skip
    assert v.reason.startswith("proved nothing: no request was retracted (pre-retraction token-layers vs the "
                               "unretracted reference: fix on 0 of 0 differ (0 of 3 requests retracted)"), v.reason
    got = json.loads(capsys.readouterr().out.split("retraction: ", 1)[1].splitlines()[0])
    assert got["retract"]["rules"] == ["sampling-time"] and got["retract"]["requests"] == 3, got


def test_router_reference_equals_the_tests_reference(tiny_model):
    """engine_checks.Router (transformers' router, on the GPU there) = rollout/models/reference.py hf_router_topk."""
    from rollout.models.reference import hf_router_topk
    from engine_checks import Router, prompts

    router = Router(tiny_model, device="cpu")
    for seq in prompts(3):
        assert router(seq) == hf_router_topk(tiny_model, seq)


_ROUTER_PROBE = """
import json, sys
sys.path[:0] = sys.argv[2:]
import transformers
from engine_checks import Router, prompts
from rollout.models.tiny import expected_experts
r = Router(sys.argv[1], device="cpu")
print(json.dumps({"transformers": transformers.__version__,
                  "equal": [all(r(s)[layer] == expected_experts(s, layer) for layer in (1, 2)) for s in prompts(3)]}))
"""


def test_router_reference_with_sglang_0_5_15s_transformers(tiny_model):
    """The carried transformers (5.12.1, 0.5.15.post1's pin) routes in the MoE block: Router reads it there."""
    r = subprocess.run([str(python_of(V15)), "-c", _ROUTER_PROBE, tiny_model, str(GPU), str(ROOT / "tests"), str(ROOT)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res == {"transformers": "5.12.1", "equal": [True, True, True]}


# ---------------------------------------------------------------- judges on recorded inputs

# SGLang 0.5.15.post1's capture lines (model_runner.py init_device_graphs, eagle_worker_v2.py), as logged
RECORDED_PLAIN = """\
[2026-12-01 10:00:01] Capture target decode CUDA graph begin. backend=full, num_tokens_per_bs=1, bs=[1, 2, 4, 8, 16], avail mem=120.00 GB
[2026-12-01 10:00:03] Capture target decode CUDA graph end. elapsed=2.10 s, mem usage=0.05 GB, avail mem=119.95 GB.
sgl_kernel CPU substitute: first call of moe_align_block_size
gpu-check kernels: first call of sglang.jit_kernel.activation.silu_and_mul
"""
RECORDED_NEXTN = """\
Capture target verify CUDA graph begin. backend=full, num_tokens_per_bs=3, bs=[1, 2, 4, 8, 16], avail mem=120.00 GB
Capture target verify CUDA graph end. elapsed=2.10 s, mem usage=0.05 GB, avail mem=119.95 GB.
Capture draft decode CUDA graph begin. backend=full, num_tokens_per_bs=1, bs=[1, 2, 4, 8, 16], avail mem=119.9 GB
Capture draft decode CUDA graph end. elapsed=1.0 s, mem usage=0.01 GB, avail mem=119.9 GB.
Capture draft extend CUDA graph begin. backend=full, num_tokens_per_bs=3, bs=[1, 2, 4, 8, 16], avail mem=119.9 GB
"""


def test_graph_log_lines_are_sglang_0_5_15s():
    sp = _site_packages(python_of(V15))
    mr = (sp / "sglang/srt/model_executor/model_runner.py").read_text()
    ew = (sp / "sglang/srt/speculative/eagle_worker_v2.py").read_text()
    assert 'f"Capture {capture_name} {graph_backend[self.device]} begin. "' in mr
    assert '"cuda": "CUDA graph"' in mr and 'f"bs={capture_bs}, avail mem={before_mem:.2f} GB"' in mr
    assert 'f"Capture draft decode CUDA graph begin. backend={decode_backend}, "' in ew
    assert 'f"Capture draft extend CUDA graph begin. backend={decode_backend}, "' in ew


def test_judges_on_recorded_inputs():
    v = judges.judge_graphs("plugin", "plain", RECORDED_PLAIN)
    assert v.ok and v.line() == "gpu-check graphs[plugin]: PASS target decode bs=[1, 2, 4, 8, 16]"
    v = judges.judge_graphs("nextn", "nextn", RECORDED_NEXTN)
    assert not v.ok and "not captured: draft extend;" in v.reason and "draft extend bs=[1, 2, 4, 8, 16] (not ended)" in v.reason
    assert judges.judge_graphs("nextn", "nextn", RECORDED_NEXTN + "Capture draft extend CUDA graph end. x").ok
    assert judges.substitute_calls(RECORDED_PLAIN) == ["moe_align_block_size", "sglang.jit_kernel.activation.silu_and_mul"]

    tail = ("Traceback (most recent call last):\n  File x\nsgl_kernel_cpu.UnimplementedOp: sgl_kernel CPU substitute: "
            "op 'segment_packbits' is not implemented\n[launcher] exit 1")
    v = judges.judge_engine_up("nextn", None, tail)
    assert not v.ok and v.reason.endswith("op 'segment_packbits' is not implemented")
    assert judges.judge_engine_up("plugin", 41.27, None).line() == "gpu-check engine_up[plugin]: PASS /health 200 after 41.3 s"

    seq = [5, 6, 7]
    ref = {(5, 6, 7): {1: [[0, 1, 2, 3]] * 3, 2: [[4, 5, 6, 7]] * 3}}
    good = {"seq": seq, "routed": [[[0, 0, 0, 0], [3, 2, 1, 0], [7, 6, 5, 4]]] * 3}
    bad = {"seq": seq, "routed": good["routed"][:2] + [[[0, 0, 0, 0], [3, 2, 1, 9], [7, 6, 5, 4]]]}
    assert judges.routed_mismatches([good], ref) == {"tokens": 3, "wrong": 0, "first": None}
    res = judges.routed_mismatches([good, bad], ref)
    assert res["wrong"] == 1 and res["first"] == "request 1 token 2 layer 1: [1, 2, 3, 9] vs [0, 1, 2, 3]"
    assert not judges.judge_routed("plugin", 2, res).ok and judges.judge_routed("plugin", 1, {"tokens": 3, "wrong": 0, "first": None}).ok
    short = judges.routed_mismatches([{"seq": seq, "routed": good["routed"][:2]}], ref)
    assert short["wrong"] == 3 and "2 rows for 3 tokens" in short["first"]

    zero = {"tokens": 100, "wrong": 0, "first": None}
    raced = {"tokens": 100, "wrong": 4, "first": "request 3 token 9 layer 1: ..."}
    assert judges.judge_snapshot(raced, zero).ok and "the fix removes it" in judges.judge_snapshot(raced, zero).reason
    assert judges.judge_snapshot(zero, zero).ok and "did not show" in judges.judge_snapshot(zero, zero).reason
    v = judges.judge_snapshot(raced, raced)
    assert not v.ok and "fix on 4 of 100" in v.reason

    assert judges.judge_speed([95, 100, 99], [100, 101, 100]).ok
    v = judges.judge_speed([70, 71, 72], [100, 100, 100])
    assert not v.ok and "plugin/stock tokens/s 0.710" in v.reason
    assert not judges.judge_speed([], [1]).ok


def _answer(prompt, out, rows, pre, rule):
    return {"prompt": prompt, "output_ids": out, "routed": rows, "pre": pre, "rule": rule}


def test_retraction_judge_on_recorded_inputs():
    """The retraction check: the tokens before a request's first retraction from its stream; the rows of the
    positions computed before it vs the reference's; the verdicts for each outcome."""
    mi = lambda n: {"num_retractions": n}  # noqa: E731
    chunks = [{"output_ids": [1], "meta_info": mi(0)}, {"output_ids": [1, 2, 3], "meta_info": mi(0)},
              {"output_ids": [1, 2, 3, 4], "meta_info": mi(1)}, {"output_ids": [1, 2, 3, 4, 5], "meta_info": mi(2)}]
    assert judges.pre_retraction_tokens(chunks) == 3
    assert judges.pre_retraction_tokens(chunks[:2]) is None
    assert judges.pre_retraction_tokens(chunks[2:]) == 0

    # 2 prompt tokens, 4 output tokens: rows for positions 0..4; retracted after 3 tokens: positions 0..3 compare
    row = lambda e: [[0, 0], [e, e + 1], [e + 2, e + 3]]  # noqa: E731 - layer 0 dense, layers 1-2 MoE
    ref = [{"output_ids": [7, 8, 9, 10], "routed": [row(i) for i in range(5)]},
           {"output_ids": [7, 8, 9, 10], "routed": [row(i) for i in range(5)]}]
    layers = range(1, 3)
    good = [_answer(2, [7, 8, 9, 10], [row(i) for i in range(4)] + [row(9)], 3, "sampling-time"),
            _answer(2, [7, 8, 9, 10], [row(i) for i in range(5)], None, "sampling-time")]
    fix = judges.retraction_rows(good, ref, layers)
    assert fix == {"requests": 2, "retracted": 1, "token_layers": 8, "differ": 0, "first": None,
                   "rules": ["sampling-time"]}, fix  # position 4 (after the retraction) is not compared
    bad = [_answer(2, [7, 8, 9, 10], [row(i) for i in range(3)] + [row(5), row(4)], 3, None), good[1] | {"rule": None}]
    off = judges.retraction_rows(bad, ref, layers)
    assert off["differ"] == 2 and off["first"] == "request 0 position 3 layer 1: [5, 6] vs [3, 4]", off
    early = judges.retraction_rows([bad[0] | {"output_ids": [7, 8, 1, 1]}], ref[:1], layers)
    assert early["token_layers"] == 6 and early["differ"] == 0  # up to the first output token that differs

    v = judges.judge_retraction(fix, off, 0)
    assert v.ok and v.reason.endswith("the fixed arm equals the reference, the disabled arm differs"), v.reason
    assert "fix on 0 of 8 differ (1 of 2 requests retracted), disabled 2 of 8 (1 retracted, 0 refused)" in v.reason
    assert judges.judge_retraction(fix, {**off, "differ": 0}, 1).reason.endswith("the disabled arm is refused")
    v = judges.judge_retraction(fix, {**off, "differ": 0}, 0)
    assert v.skip and not v.ok and "the disabled arm proved nothing" in v.reason
    v = judges.judge_retraction({**fix, "retracted": 0}, off, 0)
    assert not v.ok and not v.skip and v.reason.startswith("proved nothing: no request was retracted")
    v = judges.judge_retraction(off | {"rules": ["sampling-time"]}, off, 0)
    assert not v.ok and "(first with the fix: request 0 position 3 layer 1: [5, 6] vs [3, 4])" in v.reason
    v = judges.judge_retraction(fix, fix, 0)
    assert not v.ok and "the fixes were not off" in v.reason
    v = judges.judge_retraction(off, off, 0)
    assert not v.ok and "not only 'sampling-time'" in v.reason


def test_judge_status_on_real_patches_status_output():
    from rollout.cli.engine import parse_active_fixes

    p = subprocess.run([sys.executable, "-m", "rollout.cli", "patches", "status"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    active = [ln.split()[0] for ln in p.stdout.splitlines()[1:] if ln.split()[2:3] == ["active"]]
    assert active, p.stdout
    logged = parse_active_fixes("x slime-moe-rollout plugin: active fixes: " + ", ".join(active))
    v = judges.judge_status(p.returncode, p.stdout, logged)
    assert v.ok and v.reason.startswith("SGLang ") and ", ".join(sorted(active)) in v.reason
    v = judges.judge_status(p.returncode, p.stdout, logged[1:])
    assert not v.ok and "the engine logged" in v.reason
    assert "never logged" in judges.judge_status(0, p.stdout, None).reason
    assert "retraction-rows" in active, p.stdout
    without = "\n".join(ln for ln in p.stdout.splitlines() if not ln.split()[:1] == ["retraction-rows"])
    v = judges.judge_status(0, without, [f for f in logged if f != "retraction-rows"])
    assert not v.ok and v.reason == "not active in the engine: retraction-rows"


def test_budget_shows_progress_on_a_fake_clock():
    import io

    now, out = [0.0], io.StringIO()
    b = judges.Budget(100, every=20, clock=lambda: now[0], out=out)
    for t in (0, 5, 21, 30, 45):
        now[0] = t
        b.tick("engines starting")
    assert out.getvalue().splitlines() == ["  ... engines starting: 0 s of 100 s", "  ... engines starting: 21 s of 100 s",
                                           "  ... engines starting: 45 s of 100 s"]
    assert b.left() == 55
