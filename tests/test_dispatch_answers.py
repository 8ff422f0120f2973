"""Dispatcher: failures, not segments, use up a sample's tries; every malformed 200 answer fails only its attempt.

Engines are the fake SGLang server (tests/support/fake_sglang.py) answering as SGLang 0.5.23 was recorded
answering (`answer()`, the recorded abort), or with one malformed shape each.
"""
import asyncio

import pytest
from aiohttp import web
from support.fake_sglang import FakeSGLang, answer, fact

from rollout.dispatch import Dispatcher
from rollout.engines.client import EngineClient
from rollout.placement import Placement
from rollout.types import Sample

GOOD = dict(answer([7], {"type": "length", "length": 1}, logprob=-0.5), text="")
ABORTED = fact("abort")["running"]["finish_reason"]      # a running request aborted (batch full, pause)


def _bad(**meta):
    body = dict(answer([7], {"type": "length", "length": 1}, logprob=-0.5), text="")
    body["meta_info"].update(meta)
    return body


def _no_meta():
    return {k: v for k, v in GOOD.items() if k != "meta_info"}


MALFORMED = {   # shape -> (body, field the reason names)
    "json list": ([GOOD], "body"),
    "string finish_reason": (_bad(finish_reason="length"), "meta_info.finish_reason"),
    "odd finish_reason type": (_bad(finish_reason={"type": 5}), "meta_info.finish_reason"),
    "logprob pair too short": (_bad(output_token_logprobs=[[-0.5]]), "meta_info.output_token_logprobs[0]"),
    "logprob pair of strings": (_bad(output_token_logprobs=[["x", "7"]]), "meta_info.output_token_logprobs[0]"),
    "a later pair bad": (_bad(output_token_logprobs=[[-0.5, 7], [-0.4, "8"]]), "meta_info.output_token_logprobs[1]"),
    "a bool token id": (_bad(output_token_logprobs=[[-0.5, 7], [-0.4, True]]), "meta_info.output_token_logprobs[1]"),
    "a negative token id": (_bad(output_token_logprobs=[[-0.5, -7]]), "meta_info.output_token_logprobs[0]"),
    "a null logprob": (_bad(output_token_logprobs=[[-0.5, 7], [None, 8]]), "meta_info.output_token_logprobs[1]"),
    "a pair that is an object": (_bad(output_token_logprobs=[{"0": -0.5, "1": 7}]),
                                 "meta_info.output_token_logprobs[0]"),
    "prompt_tokens null": (_bad(prompt_tokens=None), "meta_info.prompt_tokens"),
    "no meta_info": (_no_meta(), "meta_info"),
}


class _Eng:
    def __init__(self, name, port):
        self.name, self.url, self.api_key = name, f"http://127.0.0.1:{port}", "k"


async def _engine(name, reply):
    """reply(body) -> (status, json body)."""
    async def generate(request):
        status, body = reply(await request.json())
        return web.json_response(body, status=status)
    server = await FakeSGLang({"/generate": generate}, shutdown_timeout=0.5).serve()
    return server, _Eng(name, server.port)


async def _segments(d, s, most: int = 40):
    """Continue `s` segment after segment (each aborted answer is one), as the manager does, at most `most`."""
    for _ in range(most):
        await d.run(s)
        if s.status != "aborted":
            break


@pytest.mark.timeout(60)
def test_forty_segment_sample_completes_and_failures_in_a_row_still_fail():
    async def main():
        calls = {"n": 0}

        def segments(body):        # before each segment one 503; 39 aborted segments of 1 token, then length
            calls["n"] += 1
            if calls["n"] % 2:
                return 503, {"error": "busy"}
            done = calls["n"] // 2 == 40
            return 200, answer([7], {"type": "length", "length": 1} if done else ABORTED)
        server, eng = await _engine("e", segments)
        left = {"n": 40}

        def plain(body):           # 39 aborted segments of 1 token (batch full, pause), then length
            left["n"] -= 1
            return 200, answer([7], {"type": "length", "length": 1} if left["n"] == 0 else ABORTED)
        plain_srv, plain_eng = await _engine("plain", plain)
        down, eng2 = await _engine("down", lambda body: (503, {"error": "busy"}))
        try:
            async with EngineClient() as session:
                d = Dispatcher(session, {"max_new_tokens": 40}, capacity=1)     # the default max_attempts
                await d.admit(plain_eng)
                s = Sample("p/0", "p", 0, [1, 2])
                await _segments(d, s)
                assert (s.status, s.error, len(s.response_ids), s.attempts) == ("truncated", None, 40, 40), s.error
                d = Dispatcher(session, {"max_new_tokens": 40}, capacity=1, max_attempts=2, backoff_s=0.0)
                await d.admit(eng)
                s = Sample("g/0", "g", 0, [1, 2])
                await _segments(d, s)
                assert (s.status, s.error, len(s.response_ids), s.attempts) == ("truncated", None, 40, 80)
                d2 = Dispatcher(session, {"max_new_tokens": 4}, capacity=1, max_attempts=3, backoff_s=0.0)
                await d2.admit(eng2)
                f = await d2.run(Sample("h/0", "h", 0, [1, 2]))
                assert f.status == "failed" and f.attempts == 3, f
                want = "gave up after 3 failed attempts in a row (HTTP 503 on /generate from down"
                assert f.error.startswith(want), f.error
        finally:
            for srv in (server, down, plain_srv):
                await srv.cleanup()
    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("placed", [False, True], ids=["least-outstanding", "placement"])
@pytest.mark.parametrize("shape", list(MALFORMED))
def test_malformed_answer_fails_its_attempt_and_is_resent(shape, placed):
    body, field = MALFORMED[shape]

    async def main():
        bad_srv, bad = await _engine("bad", lambda b: (200, body))
        ok_srv, ok = await _engine("ok", lambda b: (200, GOOD))
        try:
            async with EngineClient() as session:
                # alone on the bad engine: the attempt fails with the engine and the field named, no exception
                d = Dispatcher(session, {"max_new_tokens": 1}, capacity=2, max_attempts=1, backoff_s=0.0,
                               placement=Placement(1, 2) if placed else None)
                await d.admit(bad)
                s = await d.run(Sample("g/0", "g", 0, [1, 2]))
                assert (s.status, s.response_ids) == ("failed", []), s
                assert f"malformed answer from bad: {field} " in s.error and "\n" not in s.error, s.error
                # with a good engine beside it: re-sent there, the sample is whole
                d = Dispatcher(session, {"max_new_tokens": 1}, capacity=2, max_attempts=3, backoff_s=0.0,
                               placement=Placement(1, 2) if placed else None)
                await d.admit(bad)
                await d.admit(ok)
                s = await d.run(Sample("h/0", "h", 0, [1, 2]))
                assert (s.status, s.response_ids, s.logprobs, s.error) == ("truncated", [7], [-0.5], None), s
                assert s.engines[-1] == "ok" and s.engines.count("bad") <= 1 and d.resent == len(s.engines) - 1
        finally:
            await bad_srv.cleanup()
            await ok_srv.cleanup()
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_primer_with_null_prompt_tokens_is_a_failed_primer_not_a_crash():
    async def main():
        def reply(body):
            if body["sampling_params"]["max_new_tokens"] == 0:     # the group's primer
                return 200, _bad(prompt_tokens=None, output_token_logprobs=[], completion_tokens=0)
            return 200, GOOD
        srv, eng = await _engine("e", reply)
        try:
            async with EngineClient() as session:
                p = Placement(2, 4)
                d = Dispatcher(session, {"max_new_tokens": 1}, capacity=4, placement=p)
                await d.admit(eng)
                got = await asyncio.gather(*(d.run(Sample(f"g/{i}", "g", i, [1, 2, 3])) for i in range(2)))
                assert [(s.status, s.response_ids) for s in got] == [("truncated", [7])] * 2
                assert (p.primed, p.primer_failures) == (0, 1)
        finally:
            await srv.cleanup()
    asyncio.run(main())


def test_parse_reads_every_pair_shape_sglang_and_python_give():
    """The whole-answer read and the pair-by-pair one agree: lists or tuples, int or float logprobs (floats out),
    a float subclass (numpy's) and a third item (the token text) accepted."""
    import numpy as np

    from rollout.engines.answer import parse
    pairs = [[-0.5, 7, "a"], (-1, 8), [np.float64(-0.25), 9]]
    a = parse("e", _bad(output_token_logprobs=pairs))
    assert a.token_ids == [7, 8, 9] and a.logprobs == [-0.5, -1.0, -0.25]
    assert all(type(x) is float for x in a.logprobs)
    assert parse("e", _bad(output_token_logprobs=[])).token_ids == []

