"""Keyless engines (`rollout.engine_auth: none`) on a non-loopback host are refused by config validation,
so `config check`, `run` and `serve` exit 2 with one line before any engine starts, unless the config opts
in with `rollout.allow_unauthenticated_network: true`."""
import os

import pytest
import yaml

from rollout.cli import main
from training_configs.check import check_config
from training_configs.schema import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "training_configs", "tiny-cpu.yaml")      # engine_auth: none, managed mode


def _config(tmp_path, **rollout):
    with open(TINY) as fh:
        d = yaml.safe_load(fh)
    d["rollout"].update(rollout)
    p = tmp_path / "wide.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
@pytest.mark.parametrize("command", [["config", "check", "--no-sglang"], ["run", "--config"], ["serve", "--config"]])
def test_keyless_wide_host_refused_before_any_engine(tmp_path, capsys, monkeypatch, host, command):
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    rc = main(command + [_config(tmp_path, host=host)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert f"rollout.host {host!r} with engine_auth none" in err
    assert "rollout.allow_unauthenticated_network: true" in err


def test_explicit_opt_in_loads_and_still_warns(tmp_path):
    cfg = load_config(_config(tmp_path, host="0.0.0.0", allow_unauthenticated_network=True))
    warnings = check_config(cfg, use_sglang=False).warnings
    assert any("listen on EVERY interface" in w for w in warnings)


def test_keyed_and_loopback_engines_need_no_opt_in(tmp_path):
    load_config(_config(tmp_path, host="0.0.0.0", engine_auth="key"))
    load_config(_config(tmp_path, host="127.0.0.1"))


def test_config_changed_after_loading_is_checked_too():
    cfg = load_config(TINY)
    cfg.rollout.host = "0.0.0.0"
    with pytest.raises(ConfigError, match="keyless engines reachable from the network"):
        check_config(cfg, use_sglang=False)
