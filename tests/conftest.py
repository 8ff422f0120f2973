"""Shared fixtures: the tiny GLM-4.5 checkpoints and real SGLang CPU engines.

Engines are expensive (30-150 s to start on 2 cores) and memory-heavy, so one session-scoped
pool keeps at most one engine alive: asking for another configuration stops the current one
first (and checks by PID that its whole process tree is gone).
"""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_BUDGET_S = float(os.environ.get("SLIME_MOE_ROLLOUT_ENGINE_BUDGET", "420"))


@pytest.fixture(scope="session")
def tiny_model():
    from rollout.tiny_model import build_tiny_glm

    return build_tiny_glm(variant="random")


@pytest.fixture(scope="session")
def tiny_match_model():
    from rollout.tiny_model import build_tiny_glm

    return build_tiny_glm(variant="always-match")


class EnginePool:
    """Starts engines by key; keeps only the latest one alive."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.key = None
        self.engine = None
        self.ready_s = None
        self.stopped = {}  # key -> PIDs of its tree, for orphan checks
        self.failures = {}  # key -> error text (a start that failed is not retried)

    def get(self, key: str, opts):
        from rollout.engines.engine_launch import launch

        if key == self.key and self.engine is not None:
            return self.engine
        if key in self.failures:
            pytest.fail(f"engine {key} failed to start earlier: {self.failures[key]}")
        self.close()
        eng = launch(opts, os.path.join(self.log_dir, f"engine-{key}.log"))
        self.key, self.engine = key, eng
        try:
            self.ready_s = eng.wait_ready(ENGINE_BUDGET_S)
        except (RuntimeError, TimeoutError) as e:
            self.failures[key] = str(e)
            self.close()
            pytest.fail(f"engine {key} did not start: {e}")
        return eng

    def close(self):
        if self.engine is None:
            return
        pids = self.engine.tree_pids()
        left = self.engine.stop()
        self.stopped[self.key] = (pids, left)
        self.key, self.engine = None, None
        assert not left, f"processes left after stop: {left}"


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    pool = EnginePool(str(tmp_path_factory.mktemp("engine-logs")))
    yield pool
    pool.close()


def pids_alive(pids) -> list:
    import psutil

    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


# ---- transformers reference ------------------------------------------------------------

_HF = {}


def hf_model(path):
    """The checkpoint in transformers (fp32), cached per path."""
    if path not in _HF:
        import logging

        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_router_topk(path, token_ids) -> dict:
    """{moe_layer: [sorted expert ids per token]} from transformers' router on `token_ids`."""
    import torch

    m = hf_model(path)
    cap, handles = {}, []
    for i, layer in enumerate(m.model.layers):
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(lambda mod, a, out, i=i: cap.__setitem__(i, out[2])))
    try:
        with torch.no_grad():
            m(torch.tensor([list(token_ids)]))
    finally:
        for h in handles:
            h.remove()
    return {i: [sorted(r) for r in t.tolist()] for i, t in cap.items()}


def hf_greedy(path, token_ids, n) -> list:
    import torch

    m = hf_model(path)
    with torch.no_grad():
        out = m.generate(torch.tensor([list(token_ids)]), max_new_tokens=n, do_sample=False)
    return out[0, len(token_ids):].tolist()


def decode_routed(b64: str, num_layers: int, topk: int):
    import numpy as np
    import pybase64

    arr = np.frombuffer(pybase64.b64decode(b64), dtype=np.int32)
    return arr.reshape(-1, num_layers, topk)


def generate(engine, input_ids, n, **extra) -> dict:
    import requests

    body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": n, "temperature": 0},
            "return_routed_experts": bool(engine.opts.routed_experts)}
    body.update(extra)
    r = requests.post(engine.url + "/generate", headers=engine.headers(), json=body, timeout=600)
    assert r.status_code == 200, r.text[:500]
    return r.json()
