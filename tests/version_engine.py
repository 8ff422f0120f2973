"""A real CPU engine on another reviewed SGLang variant: the parent starts this file in the variant's
environment's python (`scripts/setup_sglang_env.sh <variant>`), which launches the preset's engine as the
product does (EngineSpec -> LocalBackend, phased readiness), runs the asked requests, stops it and prints
one JSON line. Transformers' side of each comparison stays in the parent.

Request (JSON): model, preset, group (EngineGroup fields), disable (fix names), graphs (null: eager, else
{"prefill": ...} for test_cpu_graphs.with_graphs), jobs ("prompts": each prompt alone; "per_rank":
test_cpu_graphs' DP-rank pattern; "rank_pairs": each prompt on both DP ranks at once, one prompt after
another, so every prefill step has one 14-token prompt a rank, and more rounds until both ranks replayed a
prefill graph: test_cpu_graphs.both_ranks_at_once), n (new tokens), fail_text (the engine must
not come up: only its log comes back, once this text is in it or it exited), not_ready (true: the engine
must fail readiness, e.g. die on its probes: the ReadinessError text and the log come back).
"""
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(variant: str, **request) -> dict:
    """Parent side: the child's answer; `log` is the engine's whole log text."""
    from support.engines import ENGINE_BUDGET_S
    from support.variant_runs import python_of

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    env.pop("SGLANG_PLUGINS", None)
    env.pop("SLIME_MOE_ROLLOUT_DISABLE", None)
    t0 = time.monotonic()
    p = subprocess.run([str(python_of(variant)), __file__, json.dumps(request)], env=env, capture_output=True,
                       text=True, timeout=ENGINE_BUDGET_S + 600)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    with open(got["log_path"], errors="replace") as f:
        got["log"] = f.read()
    got["took_s"] = round(time.monotonic() - t0, 1)
    print(f"{variant} {request.get('preset')} engine: {got['took_s']} s", file=sys.stderr)
    return got


def _spec(req):
    from support.engines import preset
    from test_cpu_graphs import with_graphs

    spec = preset(req.get("preset", "c"), req["model"], **req.get("group", {}))
    disable = tuple(req.get("disable", ()))
    if req.get("graphs") is not None:
        return with_graphs(spec, prefill=req["graphs"].get("prefill"), disable=disable)
    if disable:
        spec.group.env["SLIME_MOE_ROLLOUT_DISABLE"] = ",".join(disable)
    return spec


def _jobs(eng, req):
    from support.engines import generate
    from test_cpu_graphs import both_ranks_at_once, per_rank_results
    from test_engine_single import prompts

    n, kind, model = req.get("n", 9), req.get("jobs", "prompts"), req["model"]
    if kind == "per_rank":
        return [[ids, rank, out] for rank, outs in per_rank_results(eng, model, n).items() for ids, out in outs]
    if kind == "rank_pairs":   # each prompt on both DP ranks at once, one prompt after another
        return [list(x) for x in both_ranks_at_once(eng, model, n, min_rounds=len(prompts(model)))]
    return [[ids, None, generate(eng, ids, n)] for ids in prompts(model)]


def child(req) -> dict:
    from support.engines import active_fixes, exited, start_engine, stop_engine
    from test_cpu_graphs import failed_start_log

    from rollout.engines.readiness import ReadinessError

    log_dir = tempfile.mkdtemp(prefix="version-engine-")
    spec = _spec(req)
    if req.get("fail_text"):
        path = os.path.join(log_dir, "failed-start.log")
        with open(path, "w") as f:
            f.write(failed_start_log(spec, log_dir, req["fail_text"]))
        return {"log_path": path}
    t0 = time.monotonic()
    try:
        eng = start_engine(spec, log_dir)
    except ReadinessError as e:   # `not_ready`: readiness's own probes are what the engine must die on
        if not req.get("not_ready"):
            raise
        return {"not_ready": str(e), "log_path": glob.glob(os.path.join(log_dir, "*.log"))[0]}
    try:
        ready_s = round(time.monotonic() - t0, 1)
        results = _jobs(eng, req)
        time.sleep(2)
        crashed = any(isinstance(r[-1], str) for r in results)   # then the server takes itself down
        return {"ready_s": ready_s, "fixes": active_fixes(eng), "results": results,
                "alive": not exited(eng) if crashed else eng.alive(),
                "log_path": eng.log_path}
    finally:
        left = stop_engine(eng)[1]
        assert not left, f"engine processes left: {left}"


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
