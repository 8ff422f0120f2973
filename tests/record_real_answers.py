"""Record what real SGLang answers to the manager, as facts for the stand-ins (tests/facts/*.json).

    flock /tmp/engine.lock timeout 1200 .venv/bin/python tests/record_real_answers.py [abort|dp-attn|dp-plain ...]

abort:    one rank, routed experts, --max-running-requests 1; three long requests at once (one runs,
          two are queued), then `/abort_request {"abort_all": true}`: what each request gets back.
dp-attn:  tp 2 / dp 2 --enable-dp-attention; `/server_info`'s DP fields and the answer to a one-token
          probe pinned to each rank with `routed_dp_rank`.
dp-plain: tp 1 / dp 2 (two replicas, no DP attention); the same.
prefix-cache: preset c (the DP-attention miniature: dp 2, NEXTN) and preset a (one rank, no speculative
          decoding): `prompt_tokens`, `cached_tokens` and `dp_rank` of a 256-token prompt sent again to
          its rank, to the other rank, with 16 more tokens, and after a zero-token primer.
Nothing here is asserted: the file records; tests read the facts.
"""
import json
import os
import sys
import threading
import time

import requests
from support.engines import stop_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FACTS = os.path.join(ROOT, "tests", "facts")
SERVER_INFO_KEYS = ("version", "dp_size", "attn_dp_size", "enable_dp_attention", "tp_size",
                    "max_running_requests", "enable_return_routed_experts")


def _engine(spec, name):
    from support.engines import start_engine

    return start_engine(spec, f"/tmp/record-real-answers/{name}", 600)


def _headers(eng) -> dict:
    from rollout.net import auth_headers

    return auth_headers(eng.api_key)


def _server_info(eng) -> dict:
    info = requests.get(eng.url + "/server_info", headers=_headers(eng), timeout=60).json()
    return {k: info.get(k) for k in SERVER_INFO_KEYS if k in info}


def _shape(body: dict) -> dict:
    """The answer as the manager sees it, with the long lists replaced by their lengths."""
    meta = dict(body.get("meta_info", {}))
    out = {"meta_info_keys": sorted(meta), "finish_reason": meta.get("finish_reason"),
           "output_ids_len": len(body.get("output_ids") or []),
           "output_token_logprobs_len": len(meta.get("output_token_logprobs") or []),
           "completion_tokens": meta.get("completion_tokens"), "prompt_tokens": meta.get("prompt_tokens"),
           "routed_experts_present": meta.get("routed_experts") is not None}
    if meta.get("routed_experts") is not None:
        import pybase64
        out["routed_experts_int32_count"] = len(pybase64.b64decode(meta["routed_experts"])) // 4
    for k in ("dp_rank", "weight_version"):
        if k in meta:
            out[k] = meta[k]
    return out


def record_abort() -> dict:
    from support.engines import preset

    from rollout.models.tiny import build_tiny_glm

    eng = _engine(preset("a", build_tiny_glm(), max_running_requests=1), "abort")
    try:
        answers = {}

        def one(i):
            body = {"input_ids": [10 + i, 11, 12, 13, 14, 15], "rid": f"rec-{i}", "return_logprob": True,
                    "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}}
            r = requests.post(eng.url + "/generate", headers=_headers(eng), json=body, timeout=600)
            answers[i] = {"http_status": r.status_code, **_shape(r.json() if r.ok else {"text": r.text})}

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        time.sleep(2.0)  # request 0 decodes, 1 and 2 wait in the queue (max_running_requests 1)
        r = requests.post(eng.url + "/abort_request", headers=_headers(eng), json={"abort_all": True}, timeout=60)
        for t in threads:
            t.join(600)
        return {"what": "3 requests (max_new_tokens 400, ignore_eos) at once on --max-running-requests 1, "
                        "then /abort_request abort_all after ~2.6 s",
                "server_info": _server_info(eng), "abort_http_status": r.status_code,
                "running": answers.get(0), "queued": [answers.get(1), answers.get(2)]}
    finally:
        stop_engine(eng)


def record_dp(kind: str) -> dict:
    from support.engines import preset

    from rollout.models.tiny import build_tiny_glm

    if kind == "dp-attn":   # the schema's way: DP attention inside tp
        shape = dict(tp=2, dp=2, gpus_per_engine=2, enable_dp_attention=True, args={"attention_backend": "intel_amx"})
    else:                   # plain DP replicas (what SGLang also accepts; the schema asks for DP attention)
        shape = dict(tp=1, dp=2)
    eng = _engine(preset("a", build_tiny_glm(), **shape), kind)
    g = eng.spec.group
    try:
        probes = {}
        for rank in (0, 1):
            body = {"input_ids": [1], "routed_dp_rank": rank, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            r = requests.post(eng.url + "/generate", headers=_headers(eng), json=body, timeout=300)
            probes[str(rank)] = {"http_status": r.status_code, **_shape(r.json())}
        r = requests.post(eng.url + "/generate", headers=_headers(eng), timeout=300,
                          json={"input_ids": [1], "routed_dp_rank": 2, "sampling_params": {"max_new_tokens": 1}})
        return {"what": f"{kind}: /server_info DP fields; a one-token probe per routed_dp_rank (and rank 2)",
                "argv_dp": {"tp": g.tp, "dp": g.dp, "enable_dp_attention": g.enable_dp_attention},
                "server_info": _server_info(eng), "probes": probes,
                "out_of_range": {"http_status": r.status_code, "text": r.text[:300]}}
    finally:
        stop_engine(eng)


def record_prefix_cache() -> dict:
    from support.engines import preset

    from rollout.models.tiny import build_tiny_glm

    def ask(eng, ids, rank, n=4):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
        if rank is not None:
            body["routed_dp_rank"] = rank
        meta = requests.post(eng.url + "/generate", headers=_headers(eng), json=body, timeout=600).json()["meta_info"]
        return {"sent": {"prompt_len": len(ids), "routed_dp_rank": rank, "max_new_tokens": n},
                **{k: meta.get(k) for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "dp_rank")}}

    out = {}
    for name, dp in (("c", 2), ("a", 1)):
        eng = _engine(preset(name, build_tiny_glm()), f"prefix-{name}")
        try:
            p = [3 + (7 * i) % 300 for i in range(256)]
            q = [3 + (11 * i + 5) % 300 for i in range(256)]
            r1 = 1 if dp > 1 else None
            out[name] = {"server_info": _server_info(eng), "answers": [
                ask(eng, p, 0 if dp > 1 else None), ask(eng, p, 0 if dp > 1 else None), ask(eng, p, r1),
                ask(eng, p + [5] * 16, 0 if dp > 1 else None), ask(eng, q, r1, n=0), ask(eng, q, r1)]}
        finally:
            stop_engine(eng)
    out["what"] = ("prefix cache: a 256-token prompt p to rank 0, again to rank 0, to rank 1, p + 16 tokens to "
                   "rank 0; a zero-token request of q then q, on rank 1 (preset a: one rank, no rank sent)")
    return out


def main(kinds) -> None:
    import sglang

    os.makedirs(FACTS, exist_ok=True)
    for kind in kinds:
        t0 = time.time()
        rec = {"abort": record_abort, "prefix-cache": record_prefix_cache}.get(kind, lambda: record_dp(kind))()
        rec["sglang"] = sglang.__version__
        path = os.path.join(FACTS, f"sglang-{sglang.__version__}-{kind}.json")
        with open(path, "w") as fh:
            json.dump(rec, fh, indent=1, sort_keys=True)
            fh.write("\n")
        print(f"{kind}: recorded in {time.time() - t0:.0f} s -> {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["abort", "dp-attn", "dp-plain"])
