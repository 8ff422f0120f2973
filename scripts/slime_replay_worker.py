"""slime's own `prepare_routed_experts_for_routing_replay` on routed experts given in a JSON file, in a process of
its own (megatron-core's parallel state on gloo, one rank). Prints one JSON line: the replay tensor's shape,
whether it equals the captured rows, and (with "compact" in the file) what slime's preparation said on compact
tensors without the trainer-side install. Run with slime and this project on PYTHONPATH:

    python scripts/slime_replay_worker.py ROUTES.json

Used by scripts/check_against_slime.py and tests/test_slime_real.py.
"""
import json
import os
import socket
import sys
from pathlib import Path


def _replay_worker(path):
    """Prints the replay tensor of the routes in `path` (see the module docstring)."""
    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from slime.backends.megatron_utils.cp_utils import prepare_routed_experts_for_routing_replay
    blob = json.loads(Path(path).read_text())
    experts = [torch.tensor(x, dtype=torch.int32) for x in blob["experts"]]
    tokens = [torch.tensor(t) for t in blob["tokens"]]
    if blob.get("compact"):   # rollout.routed_experts.slime_compact on: slime's trainer gets compact tensors
        from types import SimpleNamespace

        from rollout.routed_experts import slime_compact
        args = SimpleNamespace(**blob["compact"])
        given = [x.to(torch.uint8) for x in experts]   # compact [T-1, moe layers * topk] as slime holds them
        try:   # a trainer without the trainer-side install stops at once
            prepare_routed_experts_for_routing_replay(given, tokens, num_experts=16, data_pad_size_multiplier=1,
                                                      sequence_parallel=False, allgather_cp=False)
            unhooked = "no error"
        except ValueError as e:
            unhooked = f"ValueError: {e}"
        assert slime_compact.install(args)
        from slime.backends.megatron_utils import cp_utils
        prepare_routed_experts_for_routing_replay = cp_utils.prepare_routed_experts_for_routing_replay
        experts = [slime_compact.to_slime(x, slime_compact.layout_from_args(args)) for x in given]
    else:
        given, unhooked = experts, None
    out = prepare_routed_experts_for_routing_replay(given, tokens, num_experts=16, data_pad_size_multiplier=1,
                                                    sequence_parallel=False, allgather_cp=False)
    kept = torch.cat([out[sum(len(t) for t in tokens[:i]):][:len(tokens[i]) - 1] for i in range(len(tokens))])
    print(json.dumps({"shape": list(out.shape), "equal_to_captured": bool(torch.equal(kept, torch.cat(experts))),
                      "unhooked": unhooked}))


if __name__ == "__main__":
    _replay_worker(sys.argv[1])
