"""Compact routed experts on the wire, for the requests that ask for it.

SGLang sends a request's routed experts as base64 of int32 ``[rows, num_hidden_layers, topk]``, dense
layers included as zeros (GLM-4.5: 2,944 bytes a token, 3,925 as base64). A request whose
``sampling_params.custom_params`` holds ``{OPT_IN_KEY: OPT_IN_VALUE}`` gets the MoE layers only, in
the smallest integer type holding the expert count (uint8 up to 256 experts, else int16), on every
hop: the scheduler replaces the request's int32 tensor by the compact one (header + body, uint8),
the detokenizer base64-encodes those bytes as it does any tensor, and the tokenizer manager splits
the header off into ``meta_info[LAYOUT_KEY]``. ``meta_info["routed_experts"]`` is then base64 of C-order
``[rows, num_moe_layers, topk]`` in that dtype. Every other request is untouched (SGLang's format).
An engine without the plugin ignores the unknown custom param.

The scheduler compacts only when it is safe: the model's MoE layers are known from its config, every
other layer is all zeros and every id is in ``[0, num_experts)``; otherwise the request keeps SGLang's
int32 payload (no layout key), which a client decodes and validates as usual.

The engine advertises the feature in ``/server_info``: each ``internal_states`` entry gets
``ADVERT_KEY`` = the layout it would send (or ``{"format": None, "reason": ...}``).
"""
import base64
import json
import struct

from sglang_patches.registry import Fix, Hook

OPT_IN_KEY = "slime_moe_rollout.routed_experts"   # in sampling_params.custom_params
OPT_IN_VALUE = "compact"
LAYOUT_KEY = "routed_experts_layout"              # meta_info key of a compact answer
ADVERT_KEY = "slime_moe_rollout.routed_experts"   # in every /server_info internal_states entry
FORMAT = "compact-v1"
MAGIC = b"SMR\xff"   # as little-endian int32 this is negative: never the start of an int32 payload
MAGIC_B64 = base64.b64encode(MAGIC + b"\0\0").decode()[:5]   # the base64 text every header starts with
HEADER_ALIGN = 6     # whole base64 quanta (3) and int16-aligned body (2)
STATIC_KEYS = ("format", "dtype", "num_hidden_layers", "moe_layers", "num_experts", "topk")

COLLECT = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor." \
          "_maybe_collect_routed_experts"
WAIT = "sglang.srt.managers.tokenizer_manager.TokenizerManager._wait_one_response"
STATE = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state"


# ---- the format (pure: also used by the client and the benchmarks) -----------------------------
def wants_compact(custom_params) -> bool:
    return isinstance(custom_params, dict) and custom_params.get(OPT_IN_KEY) == OPT_IN_VALUE


def opt_in(sampling_params: dict) -> dict:
    """``sampling_params`` with the opt-in added to its custom_params (a new dict; others kept)."""
    return {**sampling_params, "custom_params": {**(sampling_params.get("custom_params") or {}),
                                                 OPT_IN_KEY: OPT_IN_VALUE}}


def layer_runs(layers) -> list:
    """Sorted layer indices -> ``[[start, stop), ...]`` runs (GLM-4.5: ``[[3, 92]]``)."""
    runs = []
    for i in sorted(layers):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def run_layers(runs) -> list:
    return [i for a, b in runs for i in range(a, b)]


def dtype_name(num_experts: int) -> str:
    return "uint8" if num_experts <= 256 else "int16"


def layout_of(num_hidden_layers: int, moe_layers, num_experts: int, topk: int) -> dict:
    return {"format": FORMAT, "dtype": dtype_name(num_experts), "num_hidden_layers": int(num_hidden_layers),
            "moe_layers": layer_runs(moe_layers), "num_experts": int(num_experts), "topk": int(topk)}


def engine_layout(cfg):
    """The layout an engine sends, from its HF (text) config; None when its MoE layers are not known.
    DeepSeek/GLM: ``first_k_dense_replace`` (+ int ``moe_layer_freq``); Qwen-MoE: ``decoder_sparse_step``,
    ``mlp_only_layers``; others: every layer routes."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    n_layers, topk = get("num_hidden_layers"), get("num_experts_per_tok")
    n_exp = next((get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts") if get(k)), None)
    if not (n_layers and topk and n_exp) or n_exp > 32767:
        return None
    first, freq = int(get("first_k_dense_replace") or 0), get("moe_layer_freq") or 1
    step, only = int(get("decoder_sparse_step") or 1), set(get("mlp_only_layers") or ())
    if not isinstance(freq, int):
        return None
    layers = [i for i in range(n_layers) if i >= first and i % freq == 0 and (i + 1) % step == 0 and i not in only]
    return layout_of(n_layers, layers, n_exp, topk) if layers else None


def header(layout: dict, rows: int, start_len: int) -> bytes:
    text = json.dumps({**layout, "rows": int(rows), "start_len": int(start_len)}, separators=(",", ":")).encode()
    size = -(-(len(MAGIC) + 2 + len(text)) // HEADER_ALIGN) * HEADER_ALIGN
    return MAGIC + struct.pack("<H", size) + text.ljust(size - len(MAGIC) - 2)


def encode(full, layout: dict, start_len: int = 0):
    """int ``[rows, num_hidden_layers, topk]`` torch tensor -> uint8 tensor (header + compact body), or None
    when it cannot be compacted safely (other shape, a non-MoE layer not all zeros, an id out of range).
    Works on a numpy view of the tensor (torch's reductions over strided views are far slower on CPU)."""
    import numpy as np
    import torch

    L, K, E = layout["num_hidden_layers"], layout["topk"], layout["num_experts"]
    if full.dim() != 3 or tuple(full.shape[1:]) != (L, K) or full.dtype not in (torch.int32, torch.int64):
        return None
    arr = full.numpy()
    runs = layout["moe_layers"]
    if len(runs) == 1:
        a, b = runs[0]
        moe = arr[:, a:b]
        if (a and arr[:, :a].any()) or (b < L and arr[:, b:].any()):
            return None
    else:
        keep = run_layers(runs)
        dense = [i for i in range(L) if i not in set(keep)]
        if dense and arr[:, dense].any():
            return None
        moe = arr[:, keep]
    unsigned = np.uint32 if arr.dtype.itemsize == 4 else np.uint64
    if moe.size and moe.view(unsigned).max() >= E:   # a negative id wraps to a huge one
        return None
    head = header(layout, arr.shape[0], start_len)
    dtype = np.dtype(layout["dtype"])
    out = np.empty(len(head) + moe.size * dtype.itemsize, dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    np.copyto(out[len(head):].view(dtype).reshape(moe.shape), moe, casting="unsafe")
    return torch.from_numpy(out)


def split_b64(s: str):
    """A compact answer's base64 ``routed_experts`` -> (layout with rows and start_len, body base64), or
    None when it carries no header (SGLang's own int32 payload)."""
    if not isinstance(s, str) or len(s) < 8 or not s.startswith(MAGIC_B64):
        return None
    fixed = base64.b64decode(s[:8])
    if fixed[:4] != MAGIC:
        return None
    size = struct.unpack("<H", fixed[4:6])[0]
    n_chars = size // 3 * 4
    if size % HEADER_ALIGN or len(s) < n_chars:
        raise ValueError(f"routed_experts header of {size} bytes is malformed")
    return json.loads(base64.b64decode(s[:n_chars])[6:]), s[n_chars:]


# ---- the hooks -----------------------------------------------------------------------------------
_layouts = {}   # id(model_config) -> layout or None


def _layout(model_config):
    key = id(model_config)
    if key not in _layouts:
        _layouts[key] = engine_layout(getattr(model_config, "hf_text_config", None) or model_config.hf_config)
    return _layouts[key]


def compact_collected(result, self, req, *args, **kwargs):
    """AFTER the scheduler collected a finished request's routed experts: compact them if it asked."""
    if getattr(req, "routed_experts", None) is None:
        return None
    if not wants_compact(getattr(req.sampling_params, "custom_params", None)):
        return None
    layout = _layout(self.model_config)
    if layout is not None:
        out = encode(req.routed_experts, layout, getattr(req, "routed_experts_start_len", 0) or 0)
        if out is not None:
            req.routed_experts = out
    return None


def split_layout(original, self, obj, *args, **kwargs):
    """AROUND the tokenizer manager's per-request response stream: a compact answer's header becomes
    ``meta_info[LAYOUT_KEY]``. Requests that did not opt in get SGLang's own generator back."""
    gen = original(self, obj, *args, **kwargs)
    sp = getattr(obj, "sampling_params", None)
    if not (isinstance(sp, dict) and wants_compact(sp.get("custom_params"))):
        return gen
    return _split_each(gen)


async def _split_each(gen):
    try:
        async for out in gen:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            if isinstance(meta, dict):
                try:
                    got = split_b64(meta.get("routed_experts"))
                except ValueError:   # left as it came: the client names the problem
                    got = None
                if got is not None:
                    meta[LAYOUT_KEY], meta["routed_experts"] = got
            yield out
    finally:
        await gen.aclose()


async def advertise(original, self, *args, **kwargs):
    """AROUND get_internal_state (what /server_info lists per DP rank): add the layout this engine sends."""
    states = await original(self, *args, **kwargs)
    layout = _layout(self.model_config)
    info = layout if layout is not None else {"format": None, "reason": "MoE layers not known from the model config"}
    for s in states or ():
        if isinstance(s, dict):
            s[ADVERT_KEY] = dict(info)
    return states


COMPACT = Hook(COLLECT, compact_collected, "after")
SPLIT = Hook(WAIT, split_layout, "around")
ADVERTISE = Hook(STATE, advertise, "around")

FIX = Fix(
    name="compact-routed-experts",
    family="feature",
    defect=(
        "Opt-in per request (sampling_params.custom_params): routed experts travel MoE layers only in "
        "uint8/int16 on every hop, layout in meta_info; other requests keep SGLang's int32 format."
    ),
    reference="slime#2384 (host-memory spikes from routed experts)",
    test="tests/test_routed_experts_wire_engine.py::test_compact_rows_equal_int32_rows",
)
