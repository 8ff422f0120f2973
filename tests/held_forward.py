"""Test-only: a request that keeps SGLang's scheduler inside one forward step for as long as a test wants.

`HeldForward` is a CustomLogitProcessor (SGLang's `--enable-custom-logit-processor`): the scheduler
calls it while sampling the request's batch, and it burns CPU there (like a long prefill would) until
the file named by the request's `custom_params["hold"]` is removed. While it runs, the scheduler sends
no output, so SGLang's `/health_generate` window passes with no answer, whatever the machine's speed.
The engine imports this module by name: its environment puts tests/ on PYTHONPATH. Tests hold a forward
with `held_forward(engine, tmp_path)` (the engine started with `enable_custom_logit_processor` and that
PYTHONPATH).
"""
import contextlib
import os
import threading
import time

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

MAX_HOLD_S = 120.0   # a test that died without releasing the hold does not wedge the engine for good


class HeldForward(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        path = (custom_param_list or [{}])[0].get("hold")
        if path:
            open(path + ".entered", "w").close()
            end = time.monotonic() + MAX_HOLD_S
            while os.path.exists(path) and time.monotonic() < end:
                sum(range(20000))   # busy, not asleep: the scheduler uses CPU as in a long forward
        return logits


@contextlib.contextmanager
def held_forward(engine, tmp_path, budget_s: float = 120.0):
    """One request whose forward step lasts until the block ends (the scheduler is inside it on entry)."""
    import requests

    from rollout.net import auth_headers

    hold = str(tmp_path / "hold")
    open(hold, "w").close()
    body = {"input_ids": [5, 6, 7, 8], "custom_logit_processor": HeldForward.to_str(),
            "sampling_params": {"max_new_tokens": 1, "custom_params": {"hold": hold}}}
    answer = []
    t = threading.Thread(target=lambda: answer.append(requests.post(
        engine.url + "/generate", headers=auth_headers(engine.api_key), json=body, timeout=600).status_code))
    t.start()
    try:
        end = time.monotonic() + budget_s
        while not os.path.exists(hold + ".entered"):
            assert t.is_alive(), f"the held request ended before its forward step: HTTP {answer}"
            assert time.monotonic() < end, f"the scheduler did not reach the held step in {budget_s:g} s"
            time.sleep(0.1)
        yield
    finally:
        os.unlink(hold)
        t.join(timeout=300)
    assert answer == [200], f"the held request failed: {answer}"
