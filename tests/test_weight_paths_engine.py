"""The package's own weight updates (`EngineClient.update_weights`) on a real SGLang CPU engine, per path and release
(e2e: one engine per release and scenario, 0.5.23 and 0.5.19, each from its own environment).

Per path, three streamed requests are in flight when the update starts: from disk (another checkpoint), from a
tensor (one parameter of it, serialized as slime serializes its buckets) and over a distributed update group
(the base checkpoint's embedding broadcast by a trainer rank 0 in this process, as slime's
update_weight_from_distributed.py sends it, with the gloo backend: the engine's rank joins through
/init_weights_update_group while the trainer joins, and receives while the trainer broadcasts). Every request
finishes with all its tokens (0 aborted), under the published version; the broadcast embedding changes the
greedy answer. On 0.5.23 the tensor and distributed updates run inside /begin_weight_update ... /end_weight_update
(a bare tensor or distributed update is refused there: recorded as SGLang's message); on 0.5.19 they run without
(that release has no sessions).

The draft model (preset b: NEXTN on the always-match tiny model, drafts always accepted), judged by the accept
length: the MTP layer's `eh_proj` from the random variant (which drafts wrong tokens) sent from a tensor reaches
the draft on both releases; the right one broadcast back over the update group reaches it inside a session on
0.5.23 and never on 0.5.19 (the draft stays wrong: sglang#34495). The target ignores MTP-layer names, so the
answers stay.

This file's `__main__` is the child that runs one release's engine and prints JSON.
"""
import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from support.variant_runs import python_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE, NEW = 4, 96
PROMPTS = [[10 + (i * 37 + j * 11) % 180 for j in range(12)] for i in range(3)]
PROBE = [[20 + (j * 13) % 150 for j in range(10)]]
TENSOR = "model.embed_tokens.weight"
EH_PROJ = "model.layers.3.eh_proj.weight"   # the MTP layer's (rollout.models.tiny: NUM_LAYERS 3); the target skips it
GROUP = "weight-paths"


_HELD = []   # the sent tensors: their shared memory must outlive the engine's read of it


def _checkpoint_tensor(model_dir: str, name: str):
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(os.listdir(model_dir)):
        if file.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, file)))
    return weights[name]


def _tensor_bucket(model_dir: str, name: str = TENSOR) -> list:
    """One serialized entry (TP 1) holding `name` from `model_dir`, as slime serializes a bucket (each bucket is
    read once: the engine's read releases its shared memory)."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer

    torch.multiprocessing.set_sharing_strategy("file_system")
    _HELD.append(_checkpoint_tensor(model_dir, name).clone())
    return [MultiprocessingSerializer.serialize([(name, _HELD[-1])], output_str=True)]


class Trainer:
    """Rank 0 of a gloo update group with the engine's one TP rank (rank 1), as slime's
    connect_rollout_engines_from_distributed / update_weights_from_distributed run it: the engine's HTTP call and
    the trainer's side of the group (SGLang's own group helper, the one the engine joins with) run at once."""

    TIMEOUT_S = 120   # gloo's collectives wait 30 min by default: a refused update would hang the broadcast

    def __init__(self, client, engine):
        self.client, self.engine, self.group = client, engine, None

    async def connect(self):
        from datetime import timedelta

        from rollout.net import free_port
        from sglang.srt.utils import init_custom_process_group

        port = free_port()
        join = lambda: init_custom_process_group(  # noqa: E731
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=GROUP,
            timeout=timedelta(seconds=self.TIMEOUT_S))
        _, self.group = await asyncio.gather(
            self.client.init_weights_update_group(self.engine, "127.0.0.1", port, 1, 2, GROUP, backend="gloo"),
            asyncio.to_thread(join))

    async def send(self, name: str, tensor, weight_version: str):
        """One bucket of one tensor: the engine's receive call and the broadcast at once."""
        import torch.distributed as dist

        await asyncio.gather(
            self.client.update_weights_from_distributed(self.engine, [name], [str(tensor.dtype).split(".")[-1]],
                                                        [list(tensor.shape)], GROUP, weight_version),
            asyncio.to_thread(dist.broadcast, tensor, 0, self.group))

    async def close(self):
        import torch.distributed as dist

        await self.client.destroy_weights_update_group(self.engine, GROUP)
        dist.destroy_process_group(self.group)


async def _greedy(client, e, n: int) -> dict:
    out = await client.generate(e, {"input_ids": PROBE[0], "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    return {"ids": out["output_ids"], "accept_length": out["meta_info"].get("spec_accept_length")}


async def _in_flight(client, eng, update):
    """Stream PROMPTS; once each has BEFORE tokens run `update()`; returns (tokens at the update, final answers)."""
    import aiohttp

    seen, last = [0] * len(PROMPTS), [None] * len(PROMPTS)

    async def one(session, i):
        body = {"input_ids": PROMPTS[i], "stream": True,
                "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
        async with session.post(eng.url + "/generate", json=body) as r:
            async for raw in r.content:
                if raw.startswith(b"data: {"):
                    last[i] = json.loads(raw[6:])
                    seen[i] = len(last[i].get("output_ids") or [])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        tasks = [asyncio.create_task(one(session, i)) for i in range(len(PROMPTS))]
        while min(seen) < BEFORE and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        at_update = list(seen)
        await update()
        await asyncio.gather(*tasks)
    return at_update, [{"tokens": len(b["output_ids"]), "finish": b["meta_info"]["finish_reason"]["type"],
                        "weight_version": b["meta_info"].get("weight_version")} for b in last]


def _on_engine(preset_name: str, model: str, prefix: str, budget_s: float, scenario) -> dict:
    """`await scenario(client, eng, e)` on a fresh engine of `preset_name` (`e`: what the client reads of an
    engine); the engine is stopped after it, no process of it left."""
    import tempfile

    from support.engines import preset, start_engine, stop_engine

    from rollout.engines.client import EngineClient

    eng = start_engine(preset(preset_name, model, api_key=""), tempfile.mkdtemp(prefix=prefix), budget_s)

    async def main():
        async with EngineClient() as client:
            return await scenario(client, eng, SimpleNamespace(name="e0", url=eng.url, api_key=""))

    try:
        return asyncio.run(main())
    finally:
        left = stop_engine(eng)[1]
        assert not left, f"engine processes left: {left}"


def run_child(model: str, other: str, budget_s: float) -> dict:
    from rollout.engines.client import has_weight_sessions
    from rollout.errors import EngineRejected

    async def scenario(client, eng, e):
        out = {}
        out["version"] = await client.sglang_version(e)
        disk = lambda: client.update_weights_from_disk(e, other, "2")  # noqa: E731
        out["disk"] = await _in_flight(client, eng, lambda: client.update_weights(e, disk, "2", path="disk"))
        tensor = lambda: client.update_weights_from_tensor(e, _tensor_bucket(other), "3")  # noqa: E731
        out["tensor"] = await _in_flight(client, eng, lambda: client.update_weights(e, tensor, "3", path="tensor"))
        try:
            await client.update_weights_from_tensor(e, _tensor_bucket(other), "4")
            out["bare_tensor"] = "accepted"
        except EngineRejected as err:
            out["bare_tensor"] = err.body
        out["final_version"] = await client.weight_version(e)
        trainer = Trainer(client, e)
        await trainer.connect()
        out["probe_before"] = await _greedy(client, e, 8)
        base = _checkpoint_tensor(model, TENSOR)
        out["distributed"] = await _in_flight(client, eng, lambda: client.update_weights(
            e, lambda: trainer.send(TENSOR, base, "5"), "5", path="distributed"))
        out["probe_after"] = await _greedy(client, e, 8)
        if has_weight_sessions(out["version"]):   # refused before it receives: no broadcast needed
            try:
                await client.update_weights_from_distributed(e, [TENSOR], ["bfloat16"], [[1]], GROUP, "6")
                out["bare_distributed"] = "accepted"
            except EngineRejected as err:
                out["bare_distributed"] = err.body
        await trainer.close()
        return out

    return _on_engine("a", model, "engine-paths-", budget_s, scenario)


def run_draft_child(model: str, wrong_draft: str, budget_s: float) -> dict:
    """Preset b on `model` (always-match): the MTP layer's eh_proj of `wrong_draft` from a tensor, then `model`'s
    own eh_proj over the update group; the greedy answer and its accept length after each."""
    async def scenario(client, eng, e):
        out = {}
        out["version"] = await client.sglang_version(e)
        trainer = Trainer(client, e)
        await trainer.connect()
        out["before"] = await _greedy(client, e, 24)
        wrong = lambda: client.update_weights_from_tensor(e, _tensor_bucket(wrong_draft, EH_PROJ), "2")  # noqa: E731
        await client.update_weights(e, wrong, "2", path="tensor")
        out["tensor"] = await _greedy(client, e, 24)
        eh = _checkpoint_tensor(model, EH_PROJ)
        await client.update_weights(e, lambda: trainer.send(EH_PROJ, eh, "3"), "3", path="distributed")
        out["distributed"] = await _greedy(client, e, 24)
        out["final_version"] = await client.weight_version(e)
        await trainer.close()
        return out

    return _on_engine("b", model, "engine-draft-", budget_s, scenario)


def _child(variant: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    r = subprocess.run([str(python_of(variant)), os.path.abspath(__file__), *args, "480"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out))   # the measured answers, shown by pytest -rA
    assert out["version"] == variant
    return out


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", ["0.5.23", "0.5.19"])
def test_weight_paths_keep_requests(variant, tiny_model):
    from rollout.models.tiny import build_tiny_glm

    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    out = _child(variant, "paths", tiny_model, other)
    for path, version in (("disk", "2"), ("tensor", "3"), ("distributed", "5")):
        at_update, answers = out[path]
        assert min(at_update) >= BEFORE and max(at_update) < NEW, (path, at_update)
        assert answers == [{"tokens": NEW, "finish": "length", "weight_version": version}] * len(PROMPTS), (path, answers)
    if variant == "0.5.23":   # outside a session SGLang refuses a tensor or distributed update
        for bare in ("bare_tensor", "bare_distributed"):
            assert "must run between begin_weight_update() and end_weight_update()" in out[bare], out
    else:
        assert out["bare_tensor"] == "accepted" and out["final_version"] == "4", out
    # the broadcast embedding (the base checkpoint's, over the other one's) was loaded: the greedy answer changed
    assert out["probe_after"]["ids"] != out["probe_before"]["ids"], out


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", ["0.5.23", "0.5.19"])
def test_distributed_update_and_the_draft(variant, tiny_model, tiny_match_model):
    """A wrong eh_proj from a tensor reaches the draft on both releases (the accept length falls from the
    always-match level); the right one broadcast back reaches it inside a session on 0.5.23 (the accept length
    returns) and never on 0.5.19 (the draft stays wrong: sglang#34495). The target skips MTP-layer names, so the
    greedy answers stay throughout (speculative decoding keeps the target's tokens)."""
    out = _child(variant, "draft", tiny_match_model, tiny_model)
    before, tensor, distributed = out["before"], out["tensor"], out["distributed"]
    assert out["final_version"] == "3", out
    assert before["ids"] == tensor["ids"] == distributed["ids"], out
    assert before["accept_length"] >= 2.5 and tensor["accept_length"] < 1.5, out
    if variant == "0.5.23":
        assert distributed["accept_length"] >= 2.5, out
    else:
        assert distributed["accept_length"] == tensor["accept_length"], out


if __name__ == "__main__":
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    child = {"paths": run_child, "draft": run_draft_child}[sys.argv[1]]
    print(json.dumps(child(sys.argv[2], sys.argv[3], float(sys.argv[4]))))
