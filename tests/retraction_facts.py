"""Prints, as one JSON line, what the SGLang of this interpreter does around retraction (read by
tests/test_retraction_versions.py in every reviewed version's environment)."""
import importlib.util
import json
import types

import sglang
from sglang.srt.managers import io_struct
from sglang.srt.managers.schedule_batch import Req


def retracted_req(kv):
    """SGLang's own `Req.reset_for_retract` on a request that has 2 output tokens and its routed rows."""
    req = types.SimpleNamespace(retraction_count=0, routed_experts="rows", kv=kv, input_embeds=None,
                                output_ids=[5, 6], weight_version_events=[], send_token_offset=0)
    Req.reset_for_retract(req)
    return req


try:
    req = retracted_req(types.SimpleNamespace(holds_kv=False))   # 0.5.23: the KV handle stays, released
except AssertionError:
    req = retracted_req(None)                                     # 0.5.15.post1, 0.5.16: the KV handle is gone
with open(importlib.util.find_spec("sglang.srt.managers.tokenizer_manager").origin) as f:
    meta_src = f.read()  # where the tokenizer manager builds meta_info (read, not imported: fast)
print(json.dumps({
    "version": sglang.__version__,
    "pause_default_mode": io_struct.PauseGenerationReqInput().mode,
    "routed_experts_after_retract": req.routed_experts,
    "output_ids_after_retract": list(req.output_ids),
    "retraction_count": req.retraction_count,
    "meta_num_retractions": '"num_retractions"' in meta_src,
    "meta_weight_version_at_finish": '"weight_version": self.server_args.weight_version' in meta_src,
    "meta_weight_versions_spans": "add_weight_versions_to_meta_info" in meta_src,
    "spans_module": importlib.util.find_spec("sglang.srt.utils.weight_versions") is not None,
    "update_weight_version_endpoint": hasattr(io_struct, "UpdateWeightVersionReqInput"),
}))
