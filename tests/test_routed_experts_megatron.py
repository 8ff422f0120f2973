"""Routed experts into a REAL megatron-core 0.16.1 TopKRouter on CPU (gloo, world size 1).

scripts/gpu_check/megatron_replay.py (the device check's program, see its docstring) replays two kinds
of captured routing, a stand-in engine's and a payload recorded from the real SGLang CPU engine, into
the trainer's routers in ``REPLAY_FORWARD``; here it runs on CPU with its two shims, in its own process
(torch.distributed and megatron's global state never leak).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check" / "megatron_replay.py"


def test_megatron_router_replays_captured_experts():
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(SCRIPT), "cpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[0])
    assert res["replay_equal_all_tokens"] is True and res["replay_equals_captured"] is True
    assert res["real_payload_replayed"] is True
    assert res["own_choice_differs_tokens"] > 0, res   # the replay, not the routers' own choice, made them equal
    assert res["num_routers"] == 2 and res["packed_rows"] == 36
    assert res["pad_rows_per_ep_rank_spread"] <= 1, res  # replay padding spread over the 4 EP ranks
    assert res["device"] == "cpu", res


def test_an_unmet_expectation_is_named():
    sys.path.insert(0, str(SCRIPT.parent))
    from megatron_replay import unmet

    good = {"replay_equal_all_tokens": True, "replay_equals_captured": True, "own_choice_differs_tokens": 12,
            "real_payload_replayed": True, "num_routers": 2, "packed_rows": 36, "pad_rows_per_ep_rank_spread": 0,
            "device": "cuda"}
    assert unmet(good, "cuda") == []
    assert unmet({**good, "real_payload_replayed": False, "device": "cpu"}, "cuda") == [
        "the real SGLang payload replayed", "every router and tensor on cuda"]
