"""Every rollout-related flag of slime's arguments (624b824) and what plugin mode does with it.

Kinds: `honoured` (plugin mode applies it as slime's generate_rollout does), `slime` (slime itself consumes it
outside the rollout function: data source, trainer, eval rollout, logging, weight sync), `engine` (slime's engine
launcher or router process consumes it; plugin mode attaches to those engines), `unused` (slime's own
generate_rollout does not read it either), `warned` (does not apply: one warning line at attach,
`attach.router_flag_warning`), `refused` (plugin mode cannot apply it: set away from slime's default,
the first call stops with one line). `refuse(args)` applies the last rule; docs/slime.md holds the same table.
"""
from __future__ import annotations

from typing import NamedTuple

HONOURED, SLIME, ENGINE, UNUSED, WARNED, REFUSED = "honoured", "slime", "engine", "unused", "warned", "refused"


class Flag(NamedTuple):
    option: str
    kind: str
    default: object   # slime's parser default (only read for refused flags)
    what: str


_DISPATCH = ("plugin mode dispatches every request itself (least-outstanding, a group on one (engine, DP rank)); "
             "slime's router only lists the workers")

_ROWS = [
    # add_rollout_arguments
    ("--hf-checkpoint", HONOURED, None, "tokenizer for prompts without tokens"),
    ("--model-name", SLIME, None, "weight conversion"),
    ("--rollout-function-path", SLIME, None, "selects plugin mode (`rollout.slime.generate_rollout`)"),
    ("--rollout-temperature", HONOURED, None, "sampling params, as slime builds them"),
    ("--rollout-top-p", HONOURED, None, "sampling params, as slime builds them"),
    ("--rollout-top-k", HONOURED, None, "sampling params, as slime builds them"),
    ("--rollout-max-context-len", ENGINE, None, "engine context length"),
    ("--rollout-max-prompt-len", SLIME, None, "data source drops long prompts"),
    ("--rollout-max-response-len", HONOURED, None, "`max_new_tokens` minus the response so far"),
    ("--rollout-skip-special-tokens", HONOURED, None, "sampling params"),
    ("--rollout-stop", HONOURED, None, "sampling params"),
    ("--rollout-stop-token-ids", HONOURED, None, "sampling params"),
    ("--rollout-shuffle", SLIME, None, "data source"),
    ("--rollout-seed", HONOURED, None, "per-index seeds `rollout_seed + i` with deterministic inference"),
    ("--over-sampling-batch-size", HONOURED, None, "refill granularity, as slime"),
    ("--dynamic-sampling-filter-path", HONOURED, None, "slime's filter and its drop metrics"),
    ("--partial-rollout", HONOURED, None, "unfinished groups back through `data_source.add_samples`"),
    ("--mask-offpolicy-in-partial-rollout", HONOURED, None, "earlier tokens of a continued sample get loss mask 0"),
    ("--custom-generate-function-path", HONOURED, None, "called per sample, its requests through the manager"),
    ("--rollout-sample-hook-path", HONOURED, None, "slime's sample hooks before the reward"),
    ("--custom-rollout-log-function-path", SLIME, None, "slime logs the returned samples"),
    ("--custom-eval-rollout-log-function-path", SLIME, None, "slime logs the eval samples"),
    ("--buffer-filter-path", SLIME, None, "slime's buffer picks recycled groups (with `--partial-rollout`)"),
    ("--update-weight-buffer-size", SLIME, None, "weight sync"),
    ("--update-weights-interval", SLIME, None, "weight sync"),
    ("--keep-old-actor", SLIME, None, "trainer"),
    ("--rollout-data-postprocess-path", SLIME, None, "trainer, after log-probs"),
    ("--rollout-data-transport", SLIME, None, "rollout data to the trainer"),
    ("--rollout-external-engine-addrs", ENGINE, None, "slime registers them with its router; plugin mode lists them"),
    # add_fault_tolerance_arguments
    ("--use-fault-tolerance", ENGINE, None, "slime restarts dead engines; plugin mode re-lists workers every step"),
    ("--rollout-health-check-interval", ENGINE, None, "slime's health monitor"),
    ("--rollout-health-check-timeout", ENGINE, None, "slime's health monitor"),
    ("--rollout-health-check-first-wait", ENGINE, None, "slime's health monitor"),
    # add_data_arguments
    ("--num-rollout", SLIME, None, "training loop"),
    ("--num-epoch", SLIME, None, "training loop"),
    ("--disable-rollout-global-dataset", HONOURED, None,
     "with slime's default data source: refused (empty prompts; slime asserts)"),
    ("--data-source-path", SLIME, None, "slime builds the data source plugin mode reads"),
    ("--prompt-data", SLIME, None, "data source"),
    ("--apply-chat-template", SLIME, None, "data source"),
    ("--apply-chat-template-kwargs", SLIME, None, "data source"),
    ("--input-key", SLIME, None, "data source"),
    ("--label-key", SLIME, None, "data source"),
    ("--multimodal-keys", REFUSED, None, "plugin mode sends tokens only (no `image_data`)"),
    ("--metadata-key", SLIME, None, "data source"),
    ("--tool-key", SLIME, None, "data source"),
    ("--start-rollout-id", SLIME, None, "training loop"),
    ("--rollout-batch-size", HONOURED, None, "exactly this many groups"),
    ("--n-samples-per-prompt", HONOURED, None, "group size"),
    ("--global-batch-size", SLIME, None, "trainer"),
    ("--num-steps-per-rollout", SLIME, None, "trainer"),
    ("--micro-batch-size", SLIME, None, "trainer"),
    ("--balance-data", SLIME, None, "trainer"),
    ("--balance-by-flops", SLIME, None, "trainer"),
    ("--use-dynamic-batch-size", SLIME, None, "trainer"),
    ("--max-tokens-per-gpu", SLIME, None, "trainer"),
    ("--log-probs-max-tokens-per-gpu", SLIME, None, "trainer"),
    # add_eval_arguments: evaluation=True runs slime's own generate_rollout
    ("--eval-function-path", SLIME, None, "slime's eval (default: this rollout function, which delegates)"),
    ("--eval-interval", SLIME, None, "slime's eval rollout"),
    ("--eval-prompt-data", SLIME, None, "slime's eval rollout"),
    ("--eval-config", SLIME, None, "slime's eval rollout"),
    ("--skip-eval-before-train", SLIME, None, "slime's eval rollout"),
    ("--eval-input-key", SLIME, None, "slime's eval rollout"),
    ("--eval-label-key", SLIME, None, "slime's eval rollout"),
    ("--eval-tool-key", SLIME, None, "slime's eval rollout"),
    ("--n-samples-per-eval-prompt", SLIME, None, "slime's eval rollout"),
    ("--eval-temperature", SLIME, None, "slime's eval rollout"),
    ("--eval-top-p", SLIME, None, "slime's eval rollout"),
    ("--eval-top-k", SLIME, None, "slime's eval rollout"),
    ("--eval-max-response-len", SLIME, None, "slime's eval rollout"),
    ("--eval-max-prompt-len", SLIME, None, "slime's eval rollout"),
    ("--eval-min-new-tokens", SLIME, None, "slime's eval rollout"),
    ("--eval-max-context-len", SLIME, None, "slime's eval rollout"),
    # add_reward_model_arguments
    ("--rm-type", HONOURED, None, "slime's `async_rm`"),
    ("--reward-key", SLIME, None, "slime's reward post-process"),
    ("--eval-reward-key", SLIME, None, "slime's eval rollout"),
    ("--group-rm", HONOURED, None, "slime's `batched_async_rm` per group"),
    ("--rm-url", HONOURED, None, "slime's `async_rm` (remote_rm)"),
    ("--custom-rm-path", HONOURED, None, "slime's `async_rm` / `batched_async_rm`"),
    ("--custom-reward-post-process-path", SLIME, None, "slime's reward post-process"),
    ("--custom-convert-samples-to-train-data-path", SLIME, None, "slime's train-data conversion"),
    # add_rollout_buffer_arguments
    ("--rollout-buffer-url", UNUSED, None, "read by slime_plugins' rollout-buffer rollout function only"),
    ("--fetch-trajectory-retry-times", UNUSED, None, "read by slime_plugins' rollout-buffer rollout function only"),
    ("--min-batch-collection-ratio", UNUSED, None, "read by slime_plugins' rollout-buffer rollout function only"),
    ("--rollout-task-type", UNUSED, None, "read by slime_plugins' rollout-buffer rollout function only"),
    ("--loss-mask-type", SLIME, None, "slime's loss-mask helper, called by generate functions"),
    ("--data-pad-size-multiplier", SLIME, None, "trainer"),
    ("--rollout-sample-filter-path", HONOURED, None, "slime's sample filter on the batch"),
    ("--rollout-all-samples-process-path", HONOURED, None, "slime's all-samples process"),
    # slime.backends.sglang_utils.arguments (router and engines)
    ("--sglang-router-ip", HONOURED, None, "workers are listed from slime's router; custom generate functions' "
     "requests to it reach the manager"),
    ("--sglang-router-port", HONOURED, None, "as `--sglang-router-ip`"),
    ("--sglang-router-request-timeout-secs", WARNED, 14400,
     "plugin mode's requests do not go through slime's router (the manager's own timeouts apply)"),
    ("--sglang-server-concurrency", HONOURED, None, "concurrent requests per engine"),
    ("--router-policy", WARNED, "cache_aware", _DISPATCH),
    ("--router-cache-threshold", REFUSED, 0.3, _DISPATCH),
    ("--router-balance-abs-threshold", REFUSED, 10, _DISPATCH),
    ("--router-balance-rel-threshold", REFUSED, 1.2, _DISPATCH),
    ("--router-dp-aware", REFUSED, False, _DISPATCH),
    ("--router-request-timeout-secs", UNUSED, None,
     "slime sets the router's from `--sglang-router-request-timeout-secs`"),
    ("--worker-urls", ENGINE, None, "slime's router"),
    ("--prefill-num-servers", ENGINE, None, "engine launch (PD disaggregation)"),
    ("--sglang-config", ENGINE, None, "engine launch"),
    ("--sglang-enable-deterministic-inference", HONOURED, None, "per-index seeds, as slime sends them"),
    ("--use-rollout-routing-replay", HONOURED, None, "routed experts returned in slime's shape"),
]


def _dest(option: str) -> str:
    return "rollout_global_dataset" if option == "--disable-rollout-global-dataset" else \
        option[2:].replace("-", "_")


FLAGS = {_dest(o): Flag(o, k, d, w) for o, k, d, w in _ROWS}
# the rest of the `--router-*` flags (sglang_router's RouterArgs) and of the `--sglang-*` flags (SGLang's ServerArgs)
PREFIXES = {"router_": Flag("--router-*", ENGINE, None, "slime's router process (it only lists workers here)"),
            "sglang_": Flag("--sglang-*", ENGINE, None, "SGLang engines slime launches")}


def kind(dest: str):
    """The flag's entry, by dest (a prefix entry for the rest of `--router-*` / `--sglang-*`); None: not listed."""
    if dest in FLAGS:
        return FLAGS[dest]
    return next((f for p, f in PREFIXES.items() if dest.startswith(p)), None)


def refuse(args) -> None:
    """One line naming the first refused flag set away from slime's default."""
    for dest, f in FLAGS.items():
        if f.kind != REFUSED or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value != f.default:
            raise ValueError(f"{f.option} {value!r} (slime's default {f.default!r}) is not supported in plugin mode: "
                             f"{f.what}; drop the flag or use slime's own rollout function")


# flags slime's own fully-async rollout (slime.rollout.fully_async_rollout, 624b824) does not run either: the
# fully-async entry point does as slime's and says so once
FULLY_ASYNC_NOT_RUN = {
    "rollout_sample_filter_path": "--rollout-sample-filter-path",
    "rollout_all_samples_process_path": "--rollout-all-samples-process-path",
}


def fully_async_warning(args):
    """One line naming the flags set that the fully-async rollout does not run (nor does slime's own); None if none."""
    names = [o for dest, o in FULLY_ASYNC_NOT_RUN.items() if getattr(args, dest, None)]
    if not names:
        return None
    return (f"slime-moe-rollout: warning: {', '.join(names)} not run by the fully-async rollout "
            "(slime's own fully_async_rollout runs neither)")
