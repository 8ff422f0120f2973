"""Real SGLang CPU engines for tests: preset specs, start/stop through the product's readiness, the pool
that keeps at most one alive, and plain /generate calls."""
import os

import pytest

ENGINE_BUDGET_S = float(os.environ.get("SLIME_MOE_ROLLOUT_ENGINE_BUDGET", "420"))


def preset(name: str, model_path: str, *, env=None, args=None, api_key=None, **group):
    """The EngineSpec of preset `name`'s engine (`rollout.config.PRESETS`: a, b, c) serving `model_path`
    on a free port. `group`: EngineGroup fields to change; `args`: more ServerArgs fields (the group's
    extra_sglang_args); `env`: more engine environment; `api_key`: "" for a keyless engine."""
    from rollout import config as rconfig
    from rollout.net import free_port

    cfg = rconfig.load(name)
    g = cfg.engine_groups[0]
    for field, value in group.items():
        setattr(g, field, value)
    g.extra_sglang_args.update(args or {})
    g.env.update(env or {})
    spec = rconfig.engine_specs(cfg, model_path, ports=[free_port()])[0]
    if api_key is not None:
        spec.api_key = api_key
    return spec


def two_rank_dp(group):
    """Make a DP-attention group (tiny-cpu-dpattn) the lightest engine with two DP ranks: tp 2 / dp 2,
    nothing else (no EP, NEXTN or DP lm-head); routed experts stay as the group has them."""
    group.gpus_per_engine, group.tp, group.dp, group.ep, group.moe_dense_tp = 2, 2, 2, 1, None
    group.enable_dp_lm_head, group.speculative = False, None
    group.extra_sglang_args["attention_backend"] = "intel_amx"   # the profile adds it with speculative decoding only
    return group


def budgets(total_s: float = ENGINE_BUDGET_S):
    """Readiness budgets of a test engine: HTTP and server status each get `total_s` (a loaded 2-core
    machine is slow to load and warm up), the probes a third of it."""
    from training_configs.schema import ReadinessBudgets

    return ReadinessBudgets(process_s=30, http_s=total_s, server_up_s=total_s, health_generate_s=total_s / 3,
                            dp_probe_s=total_s / 3)


def start_engine(spec, log_dir: str, total_s: float = ENGINE_BUDGET_S):
    """Start `spec` with the local backend and wait through phased readiness (a line per phase on
    stderr); returns the admitted LocalEngine. Raises ReadinessError / EngineStartError. A stock witness (fixes
    disabled by SLIME_MOE_ROLLOUT_DISABLE on purpose) is admitted without them, as rollout.allow_unfixed does."""
    import sys

    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.readiness import LineView, start_ready
    from sglang_patches.registry import DISABLE_ENV

    view = LineView(lambda text: print(text, file=sys.stderr, flush=True))
    witness = bool((getattr(getattr(spec, "group", None), "env", None) or {}).get(DISABLE_ENV))
    engine, _ = start_ready(LocalBackend(log_dir), spec, budgets(total_s), view, allow_unfixed=witness)
    return engine


def stop_engine(engine) -> tuple:
    """Stop an engine; (PIDs of its tree before, PIDs still alive after)."""
    from rollout.engines.process import alive_pids

    pids = engine.tree_pids()
    engine.stop()
    return pids, alive_pids(pids)


def exited(engine, budget_s: float = 180.0) -> bool:
    """Whether `engine`'s server process exits within `budget_s`. A crashed SGLang server takes itself
    down some time after its scheduler died (it may wait 60 s for CUDA core dumps first) and after the
    connections it held dropped; on a loaded machine that takes longer still."""
    import time

    end = time.monotonic() + budget_s
    while engine.alive():
        if time.monotonic() > end:
            return False
        time.sleep(0.5)
    return True


def log_text(engine) -> str:
    from rollout.cli.engine import log_text as text

    return text(engine)


def active_fixes(engine):
    """Fix names of the plugin's log line in the engine's log (None: the plugin never logged)."""
    from rollout.cli.engine import parse_active_fixes

    return parse_active_fixes(log_text(engine))


class EnginePool:
    """Starts engines by key; keeps only the latest one alive."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.key = None
        self.engine = None
        self.stopped = {}  # key -> (PIDs of its tree, PIDs left after stop), for orphan checks
        self.failures = {}  # key -> error text (a start that failed is not retried)

    def get(self, key: str, spec):
        from rollout.engines.base import EngineStartError
        from rollout.engines.readiness import ReadinessError

        if key == self.key and self.engine is not None:
            return self.engine
        if key in self.failures:
            pytest.fail(f"engine {key} failed to start earlier: {self.failures[key]}")
        self.close()
        try:
            self.engine = start_engine(spec, os.path.join(self.log_dir, key))
        except (ReadinessError, EngineStartError) as e:
            self.failures[key] = str(e)
            pytest.fail(f"engine {key} did not start: {e}")
        self.key = key
        return self.engine

    def close(self):
        if self.engine is None:
            return
        pids, left = stop_engine(self.engine)
        self.stopped[self.key] = (pids, left)
        self.key, self.engine = None, None
        assert not left, f"processes left after stop: {left}"


def decode_routed(b64: str, num_layers: int, topk: int):
    import numpy as np
    import pybase64

    arr = np.frombuffer(pybase64.b64decode(b64), dtype=np.int32)
    return arr.reshape(-1, num_layers, topk)


def generate(engine, input_ids, n, **extra) -> dict:
    import requests

    from rollout.net import auth_headers

    body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": n, "temperature": 0},
            "return_routed_experts": engine.spec.group.routed_experts}
    body.update(extra)
    r = requests.post(engine.url + "/generate", headers=auth_headers(engine.api_key), json=body, timeout=600)
    assert r.status_code == 200, r.text[:500]
    return r.json()


class RemoteEngine:
    """An engine handle without a local process (a Ray / remote engine): the monitor sees only HTTP."""
    backend = "ray"

    def __init__(self, url):
        self.name, self.url, self.api_key = "e0", url, "k"

    def alive(self):
        return True

    def exit_reason(self):
        return "running"
