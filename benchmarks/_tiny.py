"""Shared by the engine benchmarks: the demo config reduced to one tiny CPU engine."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_engine_config(max_new_tokens=None):
    """(cfg, model path): training_configs/tiny-cpu.yaml with 1 engine and generous start-up budgets."""
    from rollout import config as rconfig

    cfg = rconfig.load(os.path.join(ROOT, "training_configs", "tiny-cpu.yaml"))
    cfg.engine_groups[0].engines = 1
    if max_new_tokens is not None:
        cfg.rollout.sampling.max_new_tokens = max_new_tokens
    for k in ("http_s", "server_up_s"):
        setattr(cfg.rollout.budgets, k, 600.0)
    return cfg, rconfig.resolve_model(cfg, root=ROOT)
