"""tokenizer-workers: with --tokenizer-worker-num > 1 SGLang's HTTP workers never call `load_plugins()`
(`init_multi_tokenizer`, sglang#38464); the fix points the workers' import string at `sglang_patches.worker_app`
(`load_plugins()`, then SGLang's own app).

- The wrapper (unit): for the call, `uvicorn.run` gets the plugin's app for SGLang's app string and the 0.5.23
  environment variable names it; one worker, a user's own app path and other apps are left alone.
- Every release (its own source, facts): the workers are started from SGLang's app string (a literal handed to
  `uvicorn.run` up to 0.5.22, `SGLANG_HTTP_SERVER_APP_PATH` on 0.5.23) and `init_multi_tokenizer` loads no plugin.
- e2e, a real SGLang CPU engine with 2 tokenizer workers (0.5.23): with the fix disabled its /server_info has no
  fix report and no advert (the workers run stock) and admission's check refuses it in one line; with the fix, admitted, /server_info
  carries the fix report and the compact routed-experts advert, and every answer carries the retraction stamp.
"""
import ast
import glob
import logging
import os
import time
from types import SimpleNamespace

import pytest
from support.variant_runs import ALL, python_of

from sglang_patches.fixes import tokenizer_workers as tw


def test_the_workers_import_the_plugins_app(monkeypatch):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, *a, **k: calls.append((app, k.get("workers"),
                                                                          os.environ.get(tw.APP_ENV))))
    monkeypatch.delenv(tw.APP_ENV, raising=False)

    def setup(server_args, *rest):   # SGLang's _setup_and_run_http_server, as far as the app string goes
        uvicorn.run(tw.SGLANG_APP, workers=server_args.tokenizer_worker_num)
        uvicorn.run("other:app", workers=server_args.tokenizer_worker_num)
        return "served"

    assert tw.load_in_workers(setup, SimpleNamespace(tokenizer_worker_num=2)) == "served"
    assert calls == [(tw.WORKER_APP, 2, tw.WORKER_APP), ("other:app", 2, tw.WORKER_APP)]
    assert uvicorn.run.__name__ == "<lambda>" and tw.APP_ENV not in os.environ   # restored after the call
    calls.clear()
    tw.load_in_workers(setup, server_args=SimpleNamespace(tokenizer_worker_num=1))
    assert calls == [(tw.SGLANG_APP, 1, None), ("other:app", 1, None)]   # one worker: SGLang's in-process app


def test_a_users_own_app_is_left_alone_with_one_line(monkeypatch, caplog):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, *a, **k: None)
    monkeypatch.setenv(tw.APP_ENV, "mine:app")
    with caplog.at_level(logging.WARNING, logger="slime_moe_rollout"):
        tw.load_in_workers(lambda sa: None, SimpleNamespace(tokenizer_worker_num=2))
    assert os.environ[tw.APP_ENV] == "mine:app"
    assert [r.getMessage() for r in caplog.records] == [
        f"slime-moe-rollout tokenizer-workers: {tw.APP_ENV}=mine:app is your own app: it must call "
        "sglang.srt.plugins.load_plugins() for the fixes to reach the HTTP workers"]


def test_a_failing_wrapper_serves_as_sglang_would(monkeypatch, caplog):
    monkeypatch.setattr(tw, "worker_app", lambda sa: (_ for _ in ()).throw(RuntimeError("boom")))
    with caplog.at_level(logging.WARNING, logger="slime_moe_rollout"):
        assert tw.load_in_workers(lambda sa: "served", SimpleNamespace(tokenizer_worker_num=2)) == "served"
    assert "not applied (RuntimeError: boom)" in caplog.records[-1].getMessage()


def test_needed_only_with_more_than_one_worker():
    assert tw.FIX.needed({"tokenizer_worker_num": 2}) and not tw.FIX.needed({"tokenizer_worker_num": 1})
    assert not tw.FIX.needed({})


def _function(src: str, name: str) -> str:
    return next(ast.get_source_segment(src, n) for n in ast.walk(ast.parse(src))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


@pytest.mark.parametrize("variant", ALL)
def test_the_workers_start_from_sglangs_app_string_on_variant(variant):
    """The defect and the fix's lever, read in each release's own http_server.py."""
    site = glob.glob(str(python_of(variant).parent.parent / "lib" / "python3*" / "site-packages" / "sglang"))
    src = open(f"{site[0]}/srt/entrypoints/http_server.py").read()
    init = _function(src, "init_multi_tokenizer")
    assert "load_plugins" not in init and "load_plugins" not in src   # the workers never load plugins
    setup = _function(src, "_setup_and_run_http_server")
    assert "workers=" in setup or '"workers":' in setup
    if "SGLANG_HTTP_SERVER_APP_PATH" in setup:   # 0.5.23
        assert "uvicorn.run(app_path" in setup
        env = open(f"{site[0]}/srt/environ.py").read()
        assert f'SGLANG_HTTP_SERVER_APP_PATH = EnvStr("{tw.SGLANG_APP}")' in env
    else:
        assert f'uvicorn.run(\n                    "{tw.SGLANG_APP}",' in setup


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_tokenizer_workers_carry_the_fixes(tiny_model, tmp_path):
    import requests
    from support.engines import ENGINE_BUDGET_S, preset, start_engine

    from rollout.engines.local_backend import LocalBackend
    from rollout.engines.readiness import fix_refusal
    from sglang_patches.features.routed_experts_wire import ADVERT_KEY
    from sglang_patches.fixes.retraction_rows import META_KEY, SAMPLING_TIME
    from sglang_patches.registry import DISABLE_ENV
    from sglang_patches.report import REPORT_KEY

    def spec(env=None):   # multi-tokenizer mode refuses an API key: a keyless loopback engine; uvicorn kills a
        # worker that has not answered its health check within SGLang's 10 s (a loaded CPU imports SGLang slower)
        env = {"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "600", **(env or {})}
        return preset("a", tiny_model, api_key="", args={"tokenizer_worker_num": 2}, env=env)

    stock = LocalBackend(str(tmp_path / "stock")).start(spec({DISABLE_ENV: tw.FIX.name}))
    try:   # the fix report admission reads, from the stock workers (its other phases aside)
        info, deadline = None, time.monotonic() + ENGINE_BUDGET_S
        while info is None and time.monotonic() < deadline and stock.alive():
            try:
                info = requests.get(stock.url + "/server_info", timeout=30).json()
            except (requests.RequestException, ValueError):
                time.sleep(2)
        assert info is not None, stock.log_tail()
        assert not any(REPORT_KEY in s or ADVERT_KEY in s for s in info["internal_states"])
        line = fix_refusal(stock.name, info, False)
        print("stock:", line)
        assert line.startswith("refused: no slime-moe-rollout fix report in /server_info: the plugin is not loaded")
    finally:
        stock.stop()
    engine = start_engine(spec(), str(tmp_path / "fixed"))
    try:
        for _ in range(4):   # either worker may answer
            states = requests.get(engine.url + "/server_info", timeout=60).json()["internal_states"]
            assert all(REPORT_KEY in s and ADVERT_KEY in s for s in states), states
            report = {f["name"]: f for f in states[0][REPORT_KEY]["fixes"]}
            assert report[tw.FIX.name]["needed"] and report[tw.FIX.name]["good"], report[tw.FIX.name]
            assert states[0][ADVERT_KEY].get("format"), states[0][ADVERT_KEY]
        for i in range(6):
            body = {"input_ids": [10 + i, 11, 12], "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            meta = requests.post(engine.url + "/generate", json=body, timeout=300).json()["meta_info"]
            assert meta[META_KEY] == SAMPLING_TIME, sorted(meta)
    finally:
        engine.stop()


def test_the_fix_report_reads_0_5_23_server_args():
    """0.5.23's ServerArgs is a msgspec Struct: its fields are not in `vars()`, so the report's `needed` read none
    of them (every fix not needed, admission refusing nothing for a configuration)."""
    import msgspec

    from sglang_patches.report import args_of

    class Args(msgspec.Struct, dict=True):   # the shape of 0.5.23's ServerArgs (dict=True, fields as slots)
        tokenizer_worker_num: int = 2

    a = Args()
    a.extra = 1
    assert vars(a) == {"extra": 1}                      # what the report read before
    assert args_of(a)["tokenizer_worker_num"] == 2 and tw.FIX.needed(args_of(a))
    assert args_of(SimpleNamespace(tokenizer_worker_num=3)) == {"tokenizer_worker_num": 3}
    assert args_of(None) == {}
