"""GPU check: sglang#34319 on CUDA with SGLang's real capturer (0.5.15.post1).

The scheduler's overlap order, on CUDA streams: forward N captures into `BaseTopkCapturer`'s
reused device cache and calls its real `on_forward_end(no_copy_to_cpu=True)`; the copy stream waits
for the forward stream and runs the real `GenerationBatchResult.copy_to_cpu` (pinned D2H,
record_stream); forward N+1 is launched on the forward stream before result N is processed
(`copy_done.synchronize()`, then `finalize()`). "delayed": the copy stream is still busy (a
`torch.cuda._sleep` ahead of the D2H, as when earlier copies queue there), so forward N+1's
capture lands before the D2H: stock SGLang stores the next forward's row; with our plugin's
capture-snapshot hook the D2H reads a snapshot taken on the forward stream.

Run as `python scripts/gpu_check/capture_race.py none|plugin` (the `sglang_patches.scenarios.runner` harness).
SGLang is imported (and the plugin's hooks applied) inside sglang_imports.imports_without_cuda()
(sgl_kernel cannot travel). The code under test (BaseTopkCapturer, TopkCaptureOutput,
GenerationBatchResult.copy_to_cpu, _async_d2h) has no import-time CUDA flag and then runs on CUDA.
"""
import os
import sys
from types import SimpleNamespace

from sglang_imports import imports_without_cuda  # scripts/gpu_check: the script's own folder

from sglang_patches.scenarios.runner import main, registry

SCENARIOS, scenario = registry()
STEPS = (((10, 11, 12, 13), 100), ((14,), 900))  # a 4-token prefill, then the next decode forward
WANT = [100, 101, 102, 103, 900]                    # experts of KV slots 10..14
STOCK = [900, 101, 102, 103, 900]                   # prompt row 0 holds the decode's expert
DELAY_CYCLES = 100_000_000                          # about 50 ms of copy-stream backlog at 2 GHz


def _overlap_run(delay_cycles: int) -> list:
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    cap = BaseTopkCapturer(num_tokens=64, max_batch_size=16, num_layers=1, topk_size=2, device="cuda",
                           name="routed_experts")
    cap.host_cache.buffer.fill_(-1)
    forward, copy = torch.cuda.Stream(), torch.cuda.Stream()
    pending = []
    for locs, first in STEPS:
        with torch.cuda.stream(forward):  # the scheduler's forward_stream_ctx
            ids = torch.arange(first, first + len(locs), dtype=torch.int32, device="cuda")
            cap.capture(0, ids[:, None].expand(len(locs), 2).contiguous())
            fb = SimpleNamespace(out_cache_loc=torch.tensor(locs, device="cuda"))
            out = cap.on_forward_end(fb, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=True)
            result = GenerationBatchResult(next_token_ids=torch.zeros(1, dtype=torch.int64, device="cuda"),
                                           routed_experts_output=out)
            result.copy_done = torch.cuda.Event()
            copy.wait_stream(forward)
            with torch.cuda.stream(copy):
                if delay_cycles:
                    torch.cuda._sleep(delay_cycles)
                result.copy_to_cpu(return_logprob=False, return_hidden_states=False)
        pending.append(result)
    for result in pending:  # process_batch_result of each forward, after the next one was launched
        result.copy_done.synchronize()
        result.routed_experts_output.finalize()
    return cap.host_cache.buffer[10:15, 0, 0].tolist()


def _no_cuda():
    import torch

    return None if torch.cuda.is_available() else {"ok": False, "skip": True, "detail": "no CUDA device"}


@scenario
def capture_race_delayed_copy():
    skip = _no_cuda()
    if skip:
        return skip
    got = _overlap_run(DELAY_CYCLES)
    return {"ok": got == WANT, "rows": got, "detail": f"host rows of slots 10..14 {got}, want {WANT}"}


@scenario
def capture_race_undelayed():
    """Information only: how often the plain race hits without a busy copy stream (not judged)."""
    skip = _no_cuda()
    if skip:
        return skip
    runs = [_overlap_run(0) for _ in range(50)]
    bad = sum(r != WANT for r in runs)
    return {"ok": bad == 0, "detail": f"{bad} of 50 runs stored wrong rows (e.g. {next((r for r in runs if r != WANT), WANT)})"}


if __name__ == "__main__":
    with imports_without_cuda():
        if sys.argv[1] == "none":
            os.environ["SGLANG_PLUGINS"] = "none"
        from sglang.srt.plugins import load_plugins

        load_plugins()  # main() calls it again (idempotent): hooks are applied inside this window
        import sglang.srt.managers.utils  # noqa: F401
        import sglang.srt.state_capturer.base  # noqa: F401
    main(SCENARIOS, sys.argv[1])
