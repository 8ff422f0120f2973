"""Retraction across a weight update: routed experts no longer match the logprobs (miles#3277).

SGLang 0.5.23 `Req.reset_for_retract` drops the request's routed experts and frees its KV; the
re-prefill recomputes every row up to the retraction point and overwrites the host rows. With the
same weights the rows come back equal (measured on CPU: all rows equal the model's router). After
a weight update in between (slime/Miles `pause_generation(mode="retract")`, update, continue) the
rows of the tokens generated before the update are the NEW weights' routes, while those tokens and
their logprobs came from the OLD weights: replaying them trains on routes the sampler never used.
SGLang reports both facts in `meta_info`: `num_retractions` and `weight_versions` (spans of output
tokens per version). Such a sample is refused with a one-line reason (the manager marks it failed).
"""
from collections.abc import Mapping
from typing import Optional


def retraction_reason(meta_info: Mapping) -> Optional[str]:
    """A reason when the sample was retracted and spans more than one weight version, else None."""
    retractions = int(meta_info.get("num_retractions") or 0)
    spans = [s for s in (meta_info.get("weight_versions") or []) if isinstance(s, Mapping)]
    versions = list(dict.fromkeys(str(s.get("version")) for s in spans))
    if not retractions or len(versions) < 2:
        return None
    first_new = next(s.get("start") for s in spans if str(s.get("version")) != versions[0])
    return (f"retracted {retractions}x across weight versions {' -> '.join(versions)}: the re-prefill recomputed "
            f"the routed experts of output tokens [0, {first_new}) under newer weights than their logprobs")
