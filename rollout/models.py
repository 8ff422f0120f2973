"""The local checkpoint builders a config's `model.build` names (no hub: every model is written here)."""
import importlib

BUILDERS = {  # model.build -> (module, function(path, seed=) -> path)
    "tiny-glm45": ("rollout.tiny_model", "build_tiny_glm"),
    "near-tie-glm45": ("rollout.near_tie_model", "build_near_tie_glm"),
}


def build(name: str, path: str, seed: int = 0) -> str:
    """Write builder `name`'s checkpoint to `path` (idempotent); returns its absolute path."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model builder {name!r} (choose from {', '.join(BUILDERS)})")
    module, fn = BUILDERS[name]
    return getattr(importlib.import_module(module), fn)(path, seed=seed)
