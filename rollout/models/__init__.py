"""The local checkpoints, written here (no hub): `tiny` (large router margins, the demo) and `near_tie` (routers
near ties, `r3 check`); `build` picks the one a config's `model.build` names."""
import importlib

BUILDERS = {  # model.build -> (module, function(path, seed=) -> path)
    "tiny-glm45": ("rollout.models.tiny", "build_tiny_glm"),
    "near-tie-glm45": ("rollout.models.near_tie", "build_near_tie_glm"),
}


def build(name: str, path: str, seed: int = 0) -> str:
    """Write builder `name`'s checkpoint to `path` (idempotent); returns its absolute path."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model builder {name!r} (choose from {', '.join(BUILDERS)})")
    module, fn = BUILDERS[name]
    return getattr(importlib.import_module(module), fn)(path, seed=seed)
