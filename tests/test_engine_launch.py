"""Launch interface without starting SGLang: argv, env, parsing of the server log, CLI errors."""
import pytest

from rollout.cli import main
from rollout.engines.engine_launch import (
    EngineOptions,
    free_port,
    parse_active_fixes,
    parse_startup_timings,
    preset,
    rank_count,
    resolve,
    server_command,
    thread_binding,
)

LOG = """[2026-11-29 20:21:55] Engine startup timings (s): load_weight=0.24, kv_cache_allocation=1.68, \
scheduler_e2e=14.48, cuda_graph={prefill=0.00, decode=0.00}, tokenizer_e2e=279.12
[2026-11-29 20:17:16] slime-moe-rollout plugin: active fixes: capturer-extent, cpu-host-register
"""


def test_preset_c_argv_and_env():
    argv, env = server_command(preset("c", "/m"))
    assert argv[1:3] == ["-m", "sglang.launch_server"] and all(isinstance(a, str) for a in argv)
    s = " ".join(argv)
    for flag in ("--device cpu", "--host 127.0.0.1", "--tp-size 4", "--dp-size 2", "--ep-size 4",
                 "--moe-dense-tp-size 1", "--enable-dp-attention", "--enable-dp-lm-head",
                 "--enable-return-routed-experts", "--speculative-algorithm NEXTN", "--speculative-num-steps 2",
                 "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 3", "--attention-backend intel_amx"):
        assert flag in s
    assert "--api-key" not in argv and "--sleep-on-idle" in argv  # the key goes to a 0600 --config file
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 3  # 4 ranks


def test_preset_a_single_rank_no_binding(monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    opts = preset("a", "/m")
    assert rank_count(opts) == 1
    argv, env = server_command(opts)
    assert "--attention-backend" not in argv and "--enable-return-routed-experts" in argv
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in env


def test_resolve_fills_port_and_key_and_checks():
    r = resolve(EngineOptions(model_path="/m"))
    assert r.port > 0 and r.api_key
    assert resolve(EngineOptions(model_path="/m", port=1234, api_key="k")).api_key == "k"
    with pytest.raises(ValueError, match="tp divisible by dp"):
        resolve(EngineOptions(model_path="/m", tp=3, dp=2, enable_dp_attention=True))
    with pytest.raises(ValueError, match="lack"):
        resolve(EngineOptions(model_path="/m", speculative={"algorithm": "NEXTN"}))
    with pytest.raises(ValueError, match="unknown engine configuration"):
        preset("z", "/m")
    assert 0 < free_port() < 65536


def test_user_env_wins_and_binding_split():
    _, env = server_command(EngineOptions(model_path="/m", tp=2, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|0"}))
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0"
    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(4, [0, 1]) == "0|1|0|1"
    assert thread_binding(2, [0, 1, 2, 3]) == "0-1|2-3"


def test_log_parsers():
    t = parse_startup_timings(LOG)
    assert t == {"load_weight": 0.24, "kv_cache_allocation": 1.68, "scheduler_e2e": 14.48, "tokenizer_e2e": 279.12}
    assert parse_active_fixes(LOG) == ["capturer-extent", "cpu-host-register"]
    assert parse_startup_timings("nothing") is None and parse_active_fixes("nothing") is None


def test_cli_bad_input_is_one_line(capsys):
    assert main(["engine", "launch", "--config", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice" in err[0]
    assert main(["engine", "launch", "--config", "a", "--model-path", "/nonexistent"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_free_port_leaves_room_for_sglang_0_5_15_grpc_port(monkeypatch):
    """0.5.15.post1 refuses `SGLANG_GRPC_PORT (port + 10000) must be between 1 and 65535`: ports above
    55535 are skipped (seen on a real 0.5.15.post1 start with port 59033)."""
    import socket

    offered = iter([59033, 55536, 41000])

    class Sock:
        def __init__(self, *a):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def bind(self, addr):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", Sock)
    assert free_port() == 41000
