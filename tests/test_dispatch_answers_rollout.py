"""`rollout()` through the manager: a malformed 200 answer is re-sent, never a crash nor an empty sample.

Stand-in engines of tests/test_manager_standin.py (fakes, answering as SGLang 0.5.23 was recorded); each of
three samples gets one malformed first answer.
"""
import asyncio

import pytest
from test_manager_standin import make_manager, prompts

from rollout.stream import GroupStream
from rollout.types import SampleStatus

pytestmark = pytest.mark.timeout(60)


def _list(out):
    return [out]


def _no_meta(out):
    return {k: v for k, v in out.items() if k != "meta_info"}


def _null_prompt_tokens(out):
    out["meta_info"]["prompt_tokens"] = None
    return out


def test_rollout_resends_malformed_answers_and_delivers_whole_samples():
    async def go():
        mgr = make_manager()
        async with mgr:
            orig, spoiled = mgr.client.generate, set()
            shapes = {f"{mgr.run_id}-g{i}/0": f for i, f in enumerate((_list, _no_meta, _null_prompt_tokens))}

            async def spoil(engine, body, timeout_s):
                out = await orig(engine, body, timeout_s)
                sid = body["rid"].split("#")[0]
                if sid in shapes and sid not in spoiled:
                    spoiled.add(sid)
                    return shapes[sid](out)
                return out

            mgr.client.generate = spoil
            stream = GroupStream(10)
            res = await mgr.rollout(prompts(3), stream, batch_size=3)
            await stream.close()
            return res, [g async for g in stream], spoiled

    res, got, spoiled = asyncio.run(go())
    assert len(spoiled) == 3 and res.delivered == 3 and res.failed_samples == 0, res
    for s in (s for g in got for s in g.samples):
        assert (s.status, len(s.response_ids), s.error) == (SampleStatus.TRUNCATED, 8, None), s.sample_id
