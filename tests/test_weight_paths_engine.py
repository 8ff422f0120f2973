"""The package's own weight updates (`EngineClient.update_weights`) on a real SGLang CPU engine, per path and release
(e2e: one engine per release, 0.5.23 and 0.5.19, each from its own environment).

Per path, three streamed requests are in flight when the update starts: from disk (another checkpoint) and from a
tensor (one parameter of it, serialized as slime serializes its buckets). Every request finishes with all its
tokens (0 aborted), under the published version. On 0.5.23 the tensor update runs inside /begin_weight_update ...
/end_weight_update (a bare one is refused there: recorded as SGLang's message); on 0.5.19 it runs without (that
release has no sessions). This file's `__main__` is the child that runs one release's engine and prints JSON.
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
TENSOR = "model.embed_tokens.weight"


_HELD = []   # the sent tensors: their shared memory must outlive the engine's read of it


def _tensor_bucket(model_dir: str) -> list:
    """One serialized entry (TP 1) holding TENSOR from `model_dir`, as slime serializes a bucket (each bucket is
    read once: the engine's read releases its shared memory)."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.utils import MultiprocessingSerializer

    torch.multiprocessing.set_sharing_strategy("file_system")
    weights = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, name)))
    _HELD.append(weights[TENSOR].clone())
    return [MultiprocessingSerializer.serialize([(TENSOR, _HELD[-1])], output_str=True)]


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


def run_child(model: str, other: str, budget_s: float) -> dict:
    import tempfile

    from support.engines import preset, start_engine, stop_engine

    from rollout.engines.client import EngineClient
    from rollout.errors import EngineRejected

    eng = start_engine(preset("a", model, api_key=""), tempfile.mkdtemp(prefix="engine-paths-"), budget_s)

    async def main():
        out = {}
        async with EngineClient() as client:
            e = SimpleNamespace(name="e0", url=eng.url, api_key="")   # what the client reads of an engine
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
        return out

    try:
        return asyncio.run(main())
    finally:
        left = stop_engine(eng)[1]
        assert not left, f"engine processes left: {left}"


@pytest.mark.e2e
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("variant", ["0.5.23", "0.5.19"])
def test_weight_paths_keep_requests(variant, tiny_model):
    from rollout.models.tiny import build_tiny_glm

    other = build_tiny_glm(path=os.path.join(os.path.dirname(tiny_model), "tiny-glm45-seed1"), seed=1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    r = subprocess.run([str(python_of(variant)), os.path.abspath(__file__), tiny_model, other, "480"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["version"] == variant
    for path, version in (("disk", "2"), ("tensor", "3")):
        at_update, answers = out[path]
        assert min(at_update) >= BEFORE and max(at_update) < NEW, (path, at_update)
        assert answers == [{"tokens": NEW, "finish": "length", "weight_version": version}] * len(PROMPTS), (path, answers)
    if variant == "0.5.23":   # outside a session SGLang refuses a tensor update
        assert "must run between begin_weight_update() and end_weight_update()" in out["bare_tensor"], out["bare_tensor"]
    else:
        assert out["bare_tensor"] == "accepted" and out["final_version"] == "4", out


if __name__ == "__main__":
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    print(json.dumps(run_child(sys.argv[1], sys.argv[2], float(sys.argv[3]))))
