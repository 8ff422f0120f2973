"""`EngineClient.update_weights`: the HTTP sequence per path and release (the calls recorded in place of the wire;
tests/test_weight_paths_engine.py runs it against real engines)."""
import asyncio
from types import SimpleNamespace

import pytest

from rollout.engines.client import EngineClient, has_weight_sessions
from rollout.errors import EngineRejected

ENGINE = SimpleNamespace(name="e0", url="http://127.0.0.1:1", api_key="")


def _sequence(version, path, fail=False):
    client, calls = EngineClient(), []

    async def call(engine, method, route, *, json_body=None, **kw):
        calls.append((route, json_body))
        if route == "/server_info":
            return {"version": version}
        return ""

    async def send():
        calls.append(("send", None))
        if fail:
            raise EngineRejected("e0", "/update_weights_from_tensor", 400, "bad bucket")

    client.call = call

    async def run():
        await client.update_weights(ENGINE, send, "7", path=path)

    if fail:
        with pytest.raises(EngineRejected):
            asyncio.run(run())
    else:
        asyncio.run(run())
    return [(r, b) for r, b in calls if r != "/server_info"]


PAUSE = ("/pause_generation", {"mode": "retract"})
PUBLISH = ("/update_weight_version", {"new_version": "7", "abort_all_requests": False})
CONTINUE = ("/continue_generation", {})


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
@pytest.mark.parametrize("path", ["tensor", "distributed"])
def test_sessions_from_0_5_21(version, path):
    assert _sequence(version, path) == [PAUSE, ("/flush_cache", None), ("/begin_weight_update", {"selector": "all"}),
                                        ("send", None), ("/end_weight_update", {}), PUBLISH, CONTINUE]


@pytest.mark.parametrize("version", ["0.5.15.post1", "0.5.19", "0.5.20"])
def test_no_sessions_before_0_5_21(version):
    assert _sequence(version, "tensor") == [PAUSE, ("/flush_cache", None), ("send", None), PUBLISH, CONTINUE]


def test_disk_needs_no_session_on_any_release():
    assert _sequence("0.5.23", "disk") == [PAUSE, ("/flush_cache", None), ("send", None), PUBLISH, CONTINUE]


def test_a_failed_send_closes_the_session_and_resumes():
    assert _sequence("0.5.23", "tensor", fail=True) == [
        PAUSE, ("/flush_cache", None), ("/begin_weight_update", {"selector": "all"}), ("send", None),
        ("/end_weight_update", {}), CONTINUE]


def test_unknown_path_is_one_line():
    with pytest.raises(ValueError, match="weight update path 'nccl': one of disk, tensor, distributed"):
        asyncio.run(EngineClient().update_weights(ENGINE, None, "7", path="nccl"))


@pytest.mark.parametrize("version, want", [("0.5.15.post1", False), ("0.5.20", False), ("0.5.21", True),
                                           ("0.5.23", True), ("", False)])
def test_has_weight_sessions(version, want):
    assert has_weight_sessions(version) is want


def test_update_group_calls():
    """The group join carries its backend (gloo for CPU engines; SGLang's default is nccl) and waits as long as a
    weight update (it answers once every rank joined)."""
    from rollout.engines.client import WEIGHTS_S

    client, calls = EngineClient(), []

    async def call(engine, method, route, *, json_body=None, timeout_s=None, **kw):
        calls.append((route, json_body, timeout_s))
        return ""

    client.call = call

    async def run():
        await client.init_weights_update_group(ENGINE, "10.0.0.1", 29500, 1, 5, "g", backend="gloo")
        await client.destroy_weights_update_group(ENGINE, "g")

    asyncio.run(run())
    assert calls == [("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                                     "rank_offset": 1, "world_size": 5, "group_name": "g",
                                                     "backend": "gloo"}, WEIGHTS_S),
                     ("/destroy_weights_update_group", {"group_name": "g"}, WEIGHTS_S)]
