"""Engines: build commands, start, admit, watch and stop SGLang servers.

- `base`: the `Engine` protocol every backend's engines answer, and `EngineStartError`.
- `command`: the one command builder (engine group -> ServerArgs fields -> per-node argv/env).
- `process`: the one spawner and tree-killer of server processes, log tails.
- `local_backend`, `ray_backend`: the two backends (child processes here; Ray actors in placement groups),
  opened by name with `base.open_backend`.
- `readiness`: phased readiness, the start-up progress views, `start_ready` for one engine.
- `health`: the health monitor of admitted engines (busy is not dead).
"""
