"""scripts/setup_venv.sh's decisions: when the CPU hook goes in, and what verification rejects."""
import importlib.util
import os
from types import SimpleNamespace

from sglang_patches.cpu import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _verify():
    spec = importlib.util.spec_from_file_location("verify_venv", os.path.join(ROOT, "scripts", "verify_venv.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torch(cuda, available):
    def is_available():
        if isinstance(available, Exception):
            raise available
        return available
    return SimpleNamespace(version=SimpleNamespace(cuda=cuda), cuda=SimpleNamespace(is_available=is_available))


def test_cpu_wheel_gets_the_hook():
    import torch

    assert torch.version.cuda is None  # this machine's lock: the CPU wheel
    assert env.needs_cpu_hook() is True


def test_cuda_build_of_torch_without_a_device_gets_the_hook(monkeypatch):
    """PyPI's default torch 2.13.0 is a CUDA build; on a CPU machine no engine starts without the hook."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert env.needs_cpu_hook() is True  # the real torch.cuda.is_available() says False here
    assert env.needs_cpu_hook(_torch("12.8", False)) is True
    assert env.needs_cpu_hook(_torch("12.8", RuntimeError("Found no NVIDIA driver"))) is True


def test_cuda_device_present_no_hook():
    assert env.needs_cpu_hook(_torch("12.8", True)) is False


def test_pip_check_allows_only_sglang_no_deps_lines():
    v = _verify()
    out = ("sglang 0.5.23 requires anthropic, which is not installed.\n"
           "sglang 0.5.23 has requirement torch==2.14.1, but you have torch 2.13.0+cpu.\n")
    assert v.unexpected_pip_check(out, "0.5.23") == []
    bad = "megatron-core 0.16.1 requires packaging, which is not installed."
    assert v.unexpected_pip_check(out + bad + "\n", "0.5.23") == [bad]
    # another sglang version's lines are not expected in this venv
    assert v.unexpected_pip_check(out, "0.5.16") == out.splitlines()


def test_module_list_covers_the_lock_users_and_skips_local_code():
    mods = _verify().third_party_imports()
    for m in ("torch", "sglang", "ray", "megatron", "transformers", "pytest", "pytest_timeout", "yaml", "aiohttp"):
        assert m in mods, m
    for m in ("rollout", "sglang_patches", "training_configs", "conftest", "slime", "os"):
        assert m not in mods, m
    assert "megatron.core.transformer.moe.router_replay" in mods["megatron"]


def test_missing_module_is_named():
    v = _verify()
    bad = v.import_problems({"json": ["json"], "no_such_module_x": ["no_such_module_x"]})
    assert bad == ["import no_such_module_x: ModuleNotFoundError: No module named 'no_such_module_x'"]
