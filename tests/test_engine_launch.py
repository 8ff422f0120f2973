"""`engine launch` and the presets without starting SGLang: the command each preset config gives,
parsing of the server log, one-line CLI errors, the port helper."""
from rollout import config as rconfig
from rollout.cli import main
from rollout.cli.engine import parse_active_fixes, parse_startup_timings
from rollout.engines.command import rank_count, spec_commands, spec_fields, thread_binding
from rollout.net import free_port

LOG = """[2026-11-29 20:21:55] Engine startup timings (s): load_weight=0.24, kv_cache_allocation=1.68, \
scheduler_e2e=14.48, cuda_graph={prefill=0.00, decode=0.00}, tokenizer_e2e=279.12
[2026-11-29 20:17:16] slime-moe-rollout plugin: active fixes: capturer-extent, cpu-host-register
"""


def _spec(name, port=31234):
    cfg = rconfig.load(name)
    return rconfig.engine_specs(cfg, "/m", ports=[port])[0]


def test_presets_are_configs_in_the_one_schema():
    for name, (path, _) in rconfig.PRESETS.items():
        cfg = rconfig.load(name)
        assert cfg.source.endswith(path) and cfg.cluster.device == "cpu" and len(cfg.engine_groups) == 1
    assert rconfig.load("c").engine_groups[0].enable_dp_attention
    assert rconfig.preset_path("some/file.yaml") == "some/file.yaml"


def test_preset_c_argv_and_env():
    (c,) = spec_commands(_spec("c"))
    argv, env = c.argv, c.env
    assert argv[1:3] == ["-m", "sglang.launch_server"] and all(isinstance(a, str) for a in argv)
    s = " ".join(argv)
    for flag in ("--device cpu", "--host 127.0.0.1", "--port 31234", "--tp-size 4", "--dp-size 2", "--ep-size 4",
                 "--moe-dense-tp-size 1", "--enable-dp-attention", "--enable-dp-lm-head",
                 "--enable-return-routed-experts", "--speculative-algorithm NEXTN", "--speculative-num-steps 2",
                 "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 3", "--attention-backend intel_amx",
                 "--max-total-tokens 4096", "--mem-fraction-static 0.05"):
        assert flag in s, flag
    assert "--api-key" not in argv and "--sleep-on-idle" in argv  # a key would go to a 0600 --config file
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 3  # 4 ranks


def test_preset_a_single_rank_keyed_no_binding(monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    spec = _spec("a")
    assert rank_count(spec_fields(spec)) == 1 and spec.api_key   # a generated key
    (c,) = spec_commands(spec)
    assert "--attention-backend" not in c.argv and "--enable-return-routed-experts" in c.argv
    assert c.api_key == spec.api_key and spec.api_key not in " ".join(c.argv)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in c.env


def test_preset_b_speculative_gets_the_eagle_cpu_backend():
    (c,) = spec_commands(_spec("b"))
    assert "--speculative-algorithm NEXTN" in " ".join(c.argv) and "--attention-backend intel_amx" in " ".join(c.argv)


def test_user_env_wins_and_binding_split():
    spec = _spec("c")
    spec.group.env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|0|0|0"
    assert spec_commands(spec)[0].env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0|0|0"
    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(4, [0, 1]) == "0|1|0|1"
    assert thread_binding(2, [0, 1, 2, 3]) == "0-1|2-3"


def test_log_parsers():
    t = parse_startup_timings(LOG)
    assert t == {"load_weight": 0.24, "kv_cache_allocation": 1.68, "scheduler_e2e": 14.48, "tokenizer_e2e": 279.12}
    assert parse_active_fixes(LOG) == ["capturer-extent", "cpu-host-register"]
    assert parse_startup_timings("nothing") is None and parse_active_fixes("nothing") is None


def test_cli_bad_input_is_one_line(capsys, tmp_path):
    assert main(["engine", "launch", "--config", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x: cannot read" in err[0]
    assert main(["engine", "launch", "--config", "a", "--model-path", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["engine", "launch", "--config", "a", "--port", "80"]) == 2
    assert "--port: must be in [1024, 65000], got 80" in capsys.readouterr().err


def test_free_port_outside_the_ephemeral_range_and_below_sglang_0_5_15_grpc_limit():
    """An engine binds its port minutes after it was picked (a loaded machine): a port from the OS's
    ephemeral range was taken meanwhile by an outgoing connection ("address already in use" at the end
    of a 4-minute start). 0.5.15.post1 refuses `SGLANG_GRPC_PORT (port + 10000) must be between 1 and
    65535` (seen with port 59033): nothing above 55535."""
    from rollout.net import MAX_PORT

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    ports = [free_port() for _ in range(300)]
    assert [p for p in ports if lo <= p <= hi or not 1024 <= p <= MAX_PORT] == []


def test_free_port_skips_a_port_in_use(monkeypatch):
    import socket

    from rollout import net

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        offered = iter([taken.getsockname()[1], 12345])
        monkeypatch.setattr(net, "_RANDOM", type("Offer", (), {"choice": staticmethod(lambda rs: rs[0]),
                                                               "randint": staticmethod(lambda a, b: next(offered))}))
        assert free_port() == 12345


def test_routed_experts_line_decodes_or_says_why():
    """`engine launch`'s line about the answer's routed experts (the image check reads it)."""
    from rollout.cli.engine import routed_experts_line
    from rollout.engines.answer import parse
    from rollout.routed_experts.codec import encode_sglang
    from rollout.routed_experts.layout import MoELayout
    from support.synthetic import synthetic_full

    cfg = rconfig.load("training_configs/tiny-cpu.yaml")
    full = synthetic_full(7, MoELayout.from_model(cfg.model))   # SGLang's rows: len(tokens) - 1
    meta = {"prompt_tokens": 5, "completion_tokens": 3, "routed_experts": encode_sglang(full)}
    line = lambda: routed_experts_line(parse("e0", {"text": "", "meta_info": meta}), cfg)   # noqa: E731
    assert line() == "routed experts: 7 rows x 2 MoE layers x top-4 for 8 tokens"
    meta["completion_tokens"] = 1   # two rows too many for 6 tokens (one more is the accepted stop-edge row)
    assert line().startswith("routed experts: refused: ")
    del meta["routed_experts"]
    assert "routed_experts is missing" in line()


def test_launch_takes_the_first_engine_of_a_multi_engine_config():
    """The demo config has 2 engines: `engine launch` starts the first one on the port it picked."""
    from rollout.cli.engine import first_engine_spec

    cfg = rconfig.load("training_configs/tiny-cpu.yaml")
    assert cfg.engine_groups[0].engines == 2
    spec = first_engine_spec(cfg, "/m", 31999)
    assert (spec.name, spec.port, spec.model_path, spec.gpu_offset) == ("tiny-0", 31999, "/m", 0)


def test_open_backend_names_each_backend_and_imports_ray_only_when_chosen(tmp_path):
    import subprocess
    import sys
    code = ("import sys; from rollout.engines.base import open_backend; b = open_backend('local', sys.argv[1]); "
            "print(type(b).__name__, b.log_dir == sys.argv[1], 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["LocalBackend", "True", "False"], out.stderr
    from rollout.engines.base import BACKENDS, backend_class
    assert {kind: backend_class(kind).name for kind in BACKENDS} == {"local": "local", "ray": "ray"}


def test_cli_unresolvable_host_is_one_line(capsys, tmp_path):
    """A host no port can bind on is one line, exit 2 (before: free_port's OSError as a traceback)."""
    src = open(rconfig.load("a").source).read()
    assert "  host: 127.0.0.1\n" in src
    cfg = tmp_path / "c.yaml"
    cfg.write_text(src.replace("  host: 127.0.0.1\n", "  host: no-such-host.invalid\n"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert main(["engine", "launch", "--config", str(cfg), "--model-path", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: engine launch: cannot pick a port on host "
                                               "'no-such-host.invalid'"), err
