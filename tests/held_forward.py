"""Test-only: a request that keeps SGLang's scheduler inside one forward step for as long as a test wants.

`HeldForward` is a CustomLogitProcessor (SGLang's `--enable-custom-logit-processor`): the scheduler
calls it while sampling the request's batch, and it burns CPU there (like a long prefill would) until
the file named by the request's `custom_params["hold"]` is removed. While it runs, the scheduler sends
no output, so SGLang's `/health_generate` window passes with no answer, whatever the machine's speed.
The engine imports this module by name: its environment puts tests/ on PYTHONPATH.
"""
import os
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
