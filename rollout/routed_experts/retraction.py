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
retraction and says so in ``meta_info[META_KEY]``, with the scheduler's word in ``meta_info[EVIDENCE_KEY]``
(the stamp is earned: the scheduler that kept the rows says so, see `sglang_patches.fixes.retraction_rows`).
A retracted answer is kept whatever the weights did only when the stamp is earned: `SAMPLING_TIME` with the
scheduler's count of kept retractions (at least SGLang's `num_retractions`), or `RECOMPUTED` for a request that
asked for SGLang's rows. A stamp without that evidence, or rows the scheduler recomputed (a kept-rows cap, a
failure), is judged like an engine without the fix: refused when the weights changed.

What SGLang reports: 0.5.23 gives `num_retractions` and `weight_versions` (spans of output tokens per
version). 0.5.15.post1 and 0.5.16 give `num_retractions` and only the version at finish
(`weight_version`): there the sample is refused when it was retracted and that version differs from
the version the engine reported when the request was sent (`sent_version`), or when that is unknown.
"""
from collections.abc import Mapping
from typing import Optional

from rollout.errors import RoutedExpertsError
from sglang_patches.fixes.retraction_rows import EVIDENCE_KEY, META_KEY, RECOMPUTED, SAMPLING_TIME


def _count(raw) -> int:
    """`num_retractions` as SGLang sends it (an int, absent or null for none); anything else is refused."""
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise RoutedExpertsError(f"meta_info.num_retractions is {raw!r}, expected a count >= 0")
    return raw


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def earned(meta_info: Mapping, retractions: int) -> Optional[str]:
    """None when the engine's stamp is backed by its scheduler's word, else what the answer said instead ("" for
    no stamp: an engine without the fix)."""
    rule, word = meta_info.get(META_KEY), meta_info.get(EVIDENCE_KEY)
    if rule is None:
        return ""
    if not isinstance(word, Mapping) or word.get("rule") != rule:
        return f"stamped {rule!r} without the scheduler's evidence"
    if rule == RECOMPUTED:
        return None if word.get("asked") is True else f"its rows were recomputed ({word.get('why')})"
    if rule == SAMPLING_TIME and _is_count(word.get("kept_rows")) and _is_count(word.get("retractions")) \
            and word["retractions"] >= retractions:
        return None
    return f"stamped {rule!r} with evidence {dict(word)!r} for {retractions} retraction(s)"


def retraction_reason(meta_info: Mapping, sent_version: Optional[str] = None) -> Optional[str]:
    """A reason when the sample was retracted while the weights changed and the engine did not earn a stated
    rule for its rows, else None. A malformed `num_retractions` raises RoutedExpertsError (one line)."""
    retractions = _count(meta_info.get("num_retractions"))
    if not retractions:
        return None
    said = earned(meta_info, retractions)
    if said is None:
        return None
    said = f"{said}; " if said else ""
    spans = [s for s in (meta_info.get("weight_versions") or []) if isinstance(s, Mapping)]
    if spans:
        versions = list(dict.fromkeys(str(s.get("version")) for s in spans))
        if len(versions) < 2:
            return None
        first_new = next(s.get("start") for s in spans if str(s.get("version")) != versions[0])
        return (f"{said}retracted {retractions}x across weight versions {' -> '.join(versions)}: the re-prefill "
                f"recomputed the routed experts of output tokens [0, {first_new}) under newer weights than "
                f"their logprobs")
    done = meta_info.get("weight_version")
    if sent_version is not None and done is not None and str(done) == str(sent_version):
        return None
    return (f"{said}retracted {retractions}x and the weight version was {sent_version!r} when sent, {done!r} at the "
            f"end (this SGLang reports no per-token versions): the routed experts of tokens generated before "
            f"an update may be the newer weights' routes")
