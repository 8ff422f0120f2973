"""Two of sglang#26016's changes that SGLang handles itself, as probes of real SGLang code, shared by
tests/test_upstream_guards.py (0.5.23) and the scenario list `dp.py` (every release)."""
import asyncio
import contextlib
import time
from types import SimpleNamespace
from unittest import mock


def verify_logits_rows() -> tuple:
    """Verify-logits truncation: rows of (logits, hidden) after post_forward_mlp_sync_batch of a verify batch padded
    from 3 to 4 requests x k 4; SGLang cuts them to 3 x 4 = 12 when it handles the padding."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=4, input_ids=torch.arange(16),
                      req_pool_indices=torch.arange(4), seq_lens=torch.full((4,), 9),
                      out_cache_loc=torch.arange(16), seq_lens_sum=36,
                      spec_info=SimpleNamespace(draft_token_num=4, num_tokens_per_req=4))
    fb._original_batch_size = 3
    out = LogitsProcessorOutput(next_token_logits=torch.zeros(16, 7), hidden_states=torch.zeros(16, 5))
    fb.post_forward_mlp_sync_batch(out)
    return out.next_token_logits.shape[0], out.hidden_states.shape[0]


def health_generate_codes(extra_patches=()) -> tuple:
    """Heartbeat reset: /health_generate status codes for (old stamp + a reply, old stamp, fresh stamp);
    (200, 503, 503) when only a message received after the probe began counts."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    def probe(stamp, bump):
        tm = SimpleNamespace(server_status=ServerStatus.Up, gracefully_exit=False, is_generation=True,
                             rid_to_state={}, last_receive_tstamp=stamp,
                             server_args=SimpleNamespace(disaggregation_mode="null"))

        async def generate_request(obj, request=None):
            await asyncio.sleep(0.2)
            if bump:
                tm.last_receive_tstamp = time.time()
            yield {}

        tm.generate_request = generate_request
        req = SimpleNamespace(url=SimpleNamespace(path="/health_generate"), headers={})
        patches = [mock.patch.object(http_server, "_global_state", SimpleNamespace(tokenizer_manager=tm)),
                   mock.patch.object(http_server, "HEALTH_CHECK_TIMEOUT", 2)]
        patches += [mock.patch.object(http_server, name, value) for name, value in extra_patches]
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            return asyncio.run(http_server.health_generate(req)).status_code

    return probe(0.0, True), probe(0.0, False), probe(time.time(), False)
