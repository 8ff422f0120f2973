"""SGLang 0.5.16 (PyPI wheel; Miles before its v0.5.18 bump).

Same hooked source as 0.5.15.post1 for capturer-extent, capture-snapshot and most of the CPU family;
the capturer sizing reads the runtime context's published ServerArgs; `numa_utils.init_threads_binding`
(tp_rank=, tp_size=) is hooked.
"""
from sglang_patches.cpu.fixes import thread_binding as tb
from sglang_patches.fixes import (draft_extend_real_rows as de, draft_token_count as dtc, routed_experts_rows as rer,
                                  verify_padding_lcm as vpl)
from sglang_patches.fixes import retraction_rows as rr
from sglang_patches.registry import Port

from . import v0_5_15

FIX_TEST = v0_5_15.FIX_TEST
PORTS = {
    **{name: port for name, port in v0_5_15.PORTS.items() if not name.startswith("cpu-graphs-")},
    "routed-experts-rows": Port({rer.GROW_PUBLISHED_ARGS: "0de345206efde7bb"}, test=FIX_TEST),
    "draft-extend-real-rows": Port({de.PLANNED_ROWS: "fc2146f2662a02d7"}, test=FIX_TEST),
    "verify-padding-lcm": Port({vpl.ALIGN: "9bea5bf3a923f247"}, test=FIX_TEST),
    "draft-token-count": Port({dtc.COUNT: "897f4db58ae3db2a"}, test=FIX_TEST),
    "retraction-rows": Port({rr.KEEP_REQ_IDX: "d4331967c8e9c257", rr.SPLICE: "d5129896884dfd79",
                             rr.STATE: "ddde0e6b71c3e1cd"}),
    "cpu-thread-binding": Port({tb.BIND: "65ce8574b7efee2a"}, test="tests/test_engine_v0_5_15.py::test_thread_binding_on_0_5_16"),
}
