"""Where the features are pinned: {port table name: {feature name: Port}}, merged into `registry.table`.

compact-routed-experts hooks three targets whose source is shared by runs of releases: the scheduler's
`_maybe_collect_routed_experts` (0.5.15.post1-0.5.18 read `req.req_pool_idx`, 0.5.19+ `req.kv.req_pool_idx`),
the tokenizer manager's `_wait_one_response` (an async generator up to 0.5.18, a function returning one
from 0.5.19) and `get_internal_state` (0.5.20 reworded it). slime's image patches touch none of them.
The detokenizer's `_b64_encode_per_request` (identical in every reviewed release) encodes any tensor's
bytes, so it needs no hook.
"""
from sglang_patches.features import routed_experts_wire as w
from sglang_patches.registry import Port

_COLLECT_15, _COLLECT_19 = "d5129896884dfd79", "0a42f229acf94e72"
_WAIT_15, _WAIT_16, _WAIT_19 = "a1fba558fef5e717", "ddde0e6b71c3e1cd", "153426e70898ed8b"
_STATE_15, _STATE_20 = "88e5d21b6395d8e9", "2c8c8a78ff656d01"
FEATURE = w.FIX.name


def _port(collect, wait, state):
    return {FEATURE: Port({w.COMPACT: collect, w.SPLIT: wait, w.ADVERTISE: state})}


PORTS = {
    "v0_5_15": _port(_COLLECT_15, _WAIT_15, _STATE_15),
    "v0_5_16": _port(_COLLECT_15, _WAIT_16, _STATE_15),
    "v0_5_17": _port(_COLLECT_15, _WAIT_16, _STATE_15),
    "v0_5_18": _port(_COLLECT_15, _WAIT_16, _STATE_15),
    "v0_5_19": _port(_COLLECT_19, _WAIT_19, _STATE_15),
    "v0_5_20": _port(_COLLECT_19, _WAIT_19, _STATE_20),
    "v0_5_21": _port(_COLLECT_19, _WAIT_19, _STATE_20),
    "v0_5_22": _port(_COLLECT_19, _WAIT_19, _STATE_20),
    "v0_5_23": _port(_COLLECT_19, _WAIT_19, _STATE_20),
}
