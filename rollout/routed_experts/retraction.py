"""Retraction across a weight update: routed experts no longer match the logprobs (miles#3277).

SGLang (0.5.15.post1, 0.5.16, 0.5.23) `Req.reset_for_retract` drops the request's routed experts and
frees its KV; the re-prefill recomputes every row up to the retraction point into new KV slots and
the rows are read back from those slots when the request finishes. With the same weights the rows
come back equal (measured on the CPU engine: every row equals the model's router). After a weight
update in between (Miles's `pause_generation(mode="retract")`, update, `update_weight_version`,
`continue_generation`; slime's pause uses the default "abort" mode and retracts nothing) the rows of
the tokens generated before the update are the NEW weights' routes, while those tokens and their
logprobs came from the OLD weights (measured on the CPU engine, tests/test_retraction_engine.py).
Against such an engine the sample is refused with a one-line reason (the dispatcher marks it failed).

An engine with the plugin's `retraction-rows` fix keeps the rows each token was sampled with across a
retraction and says so in ``meta_info[META_KEY]`` (the rule its rows follow: `SAMPLING_TIME`, or
`RECOMPUTED` for a request that asked for SGLang's rows). Its answers are kept whatever the weights did:
the rows follow a stated rule (docs/fixes.md has the measurement behind the default).

What SGLang reports: 0.5.23 gives `num_retractions` and `weight_versions` (spans of output tokens per
version). 0.5.15.post1 and 0.5.16 give `num_retractions` and only the version at finish
(`weight_version`): there the sample is refused when it was retracted and that version differs from
the version the engine reported when the request was sent (`sent_version`), or when that is unknown.
"""
from collections.abc import Mapping
from typing import Optional

from rollout.errors import RoutedExpertsError
from sglang_patches.fixes.retraction_rows import META_KEY, RECOMPUTED, SAMPLING_TIME

RULES = (SAMPLING_TIME, RECOMPUTED)


def _count(raw) -> int:
    """`num_retractions` as SGLang sends it (an int, absent or null for none); anything else is refused."""
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise RoutedExpertsError(f"meta_info.num_retractions is {raw!r}, expected a count >= 0")
    return raw


def retraction_reason(meta_info: Mapping, sent_version: Optional[str] = None) -> Optional[str]:
    """A reason when the sample was retracted while the weights changed and the engine kept no stated
    rule for its rows, else None. A malformed `num_retractions` raises RoutedExpertsError (one line)."""
    retractions = _count(meta_info.get("num_retractions"))
    if not retractions or meta_info.get(META_KEY) in RULES:
        return None
    spans = [s for s in (meta_info.get("weight_versions") or []) if isinstance(s, Mapping)]
    if spans:
        versions = list(dict.fromkeys(str(s.get("version")) for s in spans))
        if len(versions) < 2:
            return None
        first_new = next(s.get("start") for s in spans if str(s.get("version")) != versions[0])
        return (f"retracted {retractions}x across weight versions {' -> '.join(versions)}: the re-prefill "
                f"recomputed the routed experts of output tokens [0, {first_new}) under newer weights than "
                f"their logprobs")
    done = meta_info.get("weight_version")
    if sent_version is not None and done is not None and str(done) == str(sent_version):
        return None
    return (f"retracted {retractions}x and the weight version was {sent_version!r} when sent, {done!r} at the "
            f"end (this SGLang reports no per-token versions): the routed experts of tokens generated before "
            f"an update may be the newer weights' routes")
