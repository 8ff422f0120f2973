"""Which /generate fields does an sglang-router build forward to its workers? (R3: return_routed_experts)

    PYTHONPATH=DIR_WITH_sglang_router python scripts/probe_router_fields.py

Starts the router the way slime's `_start_router` does (`RouterArgs` + `launch_router` in a child
process), registers one echo worker with slime's call (`POST /workers {"url", "worker_type"}`; older
routers: `/add_worker`), sends one /generate with `return_routed_experts: true` and prints one JSON line:
the router version, how registration went, the keys the worker received, and the router's
`GET /workers` answer (tests/facts/sglang-router-*-workers.json are this line, recorded).
"""
import json
import multiprocessing
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rollout.net import free_port  # noqa: E402

RECEIVED: list = []


class EchoWorker(BaseHTTPRequestHandler):
    """Answers every GET as a healthy SGLang worker and records each /generate body."""

    def log_message(self, *args):
        pass

    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({"model_path": "m", "tokenizer_path": "m", "is_generation": True, "dp_size": 1, "tp_size": 1})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.startswith("/generate"):
            RECEIVED.append(json.loads(body))
            self._json({"text": "x", "output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}}})
        else:
            self._json({})


def _run_router(router_args):
    from sglang_router.launch_router import launch_router
    launch_router(router_args)


def main() -> dict:
    import sglang_router
    from sglang_router.launch_router import RouterArgs

    worker_port, router_port = free_port(), free_port()
    server = ThreadingHTTPServer(("127.0.0.1", worker_port), EchoWorker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ra = RouterArgs()
    ra.host, ra.port = "127.0.0.1", router_port
    for name, value in (("prometheus_port", free_port()), ("disable_circuit_breaker", True),
                        ("disable_health_check", True), ("request_timeout_secs", 60)):
        if hasattr(ra, name):   # as slime sets them
            setattr(ra, name, value)
    proc = multiprocessing.Process(target=_run_router, args=(ra,), daemon=True)
    proc.start()
    base, worker = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{worker_port}"
    try:
        for _ in range(60):
            try:
                requests.get(base + "/health", timeout=1)
                break
            except requests.RequestException:
                time.sleep(0.5)
        r = requests.post(base + "/workers", json={"url": worker, "worker_type": "regular"}, timeout=10)
        register = f"POST /workers {r.status_code}"
        if r.status_code >= 400:
            register += f", /add_worker {requests.post(base + f'/add_worker?url={worker}', timeout=10).status_code}"
        for _ in range(40):   # registration is asynchronous in newer routers
            r = requests.post(base + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1},
                                                        "return_routed_experts": True}, timeout=10)
            if r.status_code == 200 and RECEIVED:
                break
            time.sleep(0.5)
        listing = requests.get(base + "/workers", timeout=10).json()   # what slime's abort (and plugin mode) reads
    finally:
        proc.terminate()
        proc.join(3)
        if proc.is_alive():
            proc.kill()
    got = RECEIVED[-1] if RECEIVED else {}
    return {"router": getattr(sglang_router, "__version__", "?"), "register": register,
            "generate_reached_worker": bool(RECEIVED), "forwards_return_routed_experts": "return_routed_experts" in got,
            "keys_received": sorted(got), "workers_listing": listing}


if __name__ == "__main__":
    print(json.dumps(main()))
