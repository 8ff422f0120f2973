"""slime's own `examples/search-r1/generate_with_search.py`, UNMODIFIED, as `--custom-generate-function-path` in
plugin mode (runs only with slime importable: SLIME_SRC on PYTHONPATH, e.g. scripts/check_against_slime.sh's
Python). It posts `text` to `args.sglang_router_ip/port` with slime's `post`; each turn must reach the worker
through the manager, every turn of a group on one worker, and its search must be called.

STAND-INs: the workers (test_slime_adapter's, answering SGLang's shape, with a search-r1 text: a search on the
first turn of a sample, an answer after), slime's router (discovery only) and the local retrieval server on
127.0.0.1:8000/retrieve that the example's config names (answering retrieval_server.py's shape).
"""
import asyncio
import importlib
import os
import sys

import pytest
from aiohttp import web
from support.fake_sglang import Loopback, answer
from support.slime_standin import REAL as SLIME_AVAILABLE
from test_slime_adapter import StandInRouter, StandInWorker, _args

from rollout.slime import adapter as slime_adapter

pytestmark = [pytest.mark.skipif(not SLIME_AVAILABLE, reason="slime is not importable (SLIME_SRC on PYTHONPATH)"),
              pytest.mark.timeout(120)]


class SearchR1Worker(StandInWorker):
    """Answers `<search>fox</search>` to a sequence it has not continued, `<answer>fox</answer>` after."""

    async def generate_rows(self, request):
        body = await request.json()
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        if n == 0:
            self.primers.append(body)
            return web.json_response(answer([], {"type": "length"}, prompt_tokens=len(ids)))
        self.requests.append(body)
        turn2 = any(ids[:len(r["input_ids"])] == r["input_ids"] and len(ids) > len(r["input_ids"])
                    for r in self.requests)
        text = "<answer>fox</answer>" if turn2 else "<search>fox</search>"
        out = answer([11, 12], {"type": "stop", "matched": "</answer>" if turn2 else "</search>"},
                     prompt_tokens=len(ids))
        return web.json_response(dict(out, text=text))


class SearchServer(Loopback):
    """STAND-IN for search-r1's local retrieval server: POST /retrieve."""

    def _app(self):
        app = web.Application()
        app.router.add_post("/retrieve", self.routes["/retrieve"])
        return app


@pytest.fixture
def search_server():
    calls = []

    async def retrieve(request):
        calls.append((await request.json())["queries"])
        return web.json_response({"result": [[{"contents": '"Fox"\nA fox is a small canid.'}]]})
    s = SearchServer({"/retrieve": retrieve}, port=8000)
    try:
        s.start()
    except OSError as e:
        pytest.skip(f"port 8000 (the example's search_url) is taken: {e}")
    s.calls = calls
    yield s
    s.stop()


def test_search_r1_runs_unmodified_through_plugin_mode(tiny_model, search_server):
    src = os.environ.get("SLIME_SRC") or os.path.dirname(os.path.dirname(
        __import__("slime").__file__))
    sys.path.insert(0, os.path.join(src, "examples", "search-r1"))
    generate_with_search = importlib.import_module("generate_with_search")   # slime's example, from SLIME_SRC
    from slime.utils.types import Sample
    from transformers import AutoTokenizer

    ws = [SearchR1Worker().start(), SearchR1Worker().start()]
    router = StandInRouter([(w.url, "regular") for w in ws]).start()
    slime_adapter.reset()
    slime_adapter.set_tokenizer(AutoTokenizer.from_pretrained(tiny_model))
    args = _args(router.port, custom_generate_function_path="generate_with_search.generate",
                 custom_rm_path="generate_with_search.reward_func", partial_rollout=False,
                 use_rollout_routing_replay=False, hf_checkpoint=tiny_model, rollout_batch_size=2,
                 rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
                 sglang_dp_size=None, ci_test=False, rollout_max_response_len=8, use_distributed_post=False)
    from slime.utils.http_utils import init_http_client
    init_http_client(args)   # what slime's RolloutManager does at start (slime/ray/rollout.py)

    class Source:
        def get_samples(self, k):
            return [[Sample(group_index=g, index=2 * g + j, prompt=f"Question {g}: what is red?",
                            label={"ground_truth": {"target": ["fox"]}}) for j in range(2)] for g in range(k)]
    try:
        out = slime_adapter.generate_rollout(args, 1, Source())
    finally:
        slime_adapter.reset()
        router.stop()
        for w in ws:
            w.stop()
    assert router.requests == []
    assert len(out.samples) == 2 and len(search_server.calls) == 4   # one search per sample
    assert sum(len(w.requests) for w in ws) == 8                        # 2 turns per sample
    for g in out.samples:
        for s in g:
            assert s.response.startswith("<search>fox</search>") and s.response.endswith("<answer>fox</answer>")
            assert "<information>" in s.response and "A fox is a small canid." in s.response   # the search's answer
            assert s.loss_mask.count(0) == len(s.loss_mask) - 4   # 2 SGLang tokens per turn trainable, the rest not
            assert s.reward == 0   # the example's own reward_func ran (slime's async_rm): no "Assistant:" answer to extract
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for gi in (0, 1):
        ids = tok.encode(f"Question {gi}: what is red?")
        on = {i for i, w in enumerate(ws) for r in w.requests if r["input_ids"][:len(ids)] == ids}
        assert len(on) == 1, (gi, on)
