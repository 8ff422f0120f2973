"""`config render`: every rendered SGLang flag parses with SGLang's own ServerArgs parser, and the
slime flags parse with a parser built the way slime builds its `--sglang-*` flags."""
import argparse
import importlib.util
import shlex

import pytest

from rollout.cli import main
from training_configs.render import (ADAPTER_ROLLOUT_FN, SLIME_UNREGISTERED, external_addrs, server_fields,
                                     sglang_args, slime_args)
from training_configs.schema import load_config, shipped_configs

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang not installed")

# slime's own (non --sglang-) flags that the renderer emits. A stand-in list, named as such: slime is
# not installable here; the names are from slime's `slime/utils/arguments.py`.
SLIME_FLAGS_STANDIN = {
    "--hf-checkpoint": 1, "--rollout-num-gpus-per-engine": 1, "--rollout-num-gpus": 1,
    "--use-rollout-routing-replay": 0, "--sglang-server-concurrency": 1, "--rollout-batch-size": 1,
    "--n-samples-per-prompt": 1, "--rollout-max-response-len": 1, "--rollout-temperature": 1,
    "--rollout-top-p": 1, "--rollout-top-k": 1, "--actor-num-nodes": 1, "--actor-num-gpus-per-node": 1,
    "--colocate": 0, "--rollout-function-path": 1, "--custom-megatron-init-path": 1, "--rollout-external-engine-addrs": "+",
}


def _slime_like_parser():
    """argparse with SGLang's flags registered the way slime's add_sglang_arguments does it:
    `--foo` becomes `--sglang-foo` (dest `sglang_foo`), minus the fields slime sets itself."""
    from sglang.srt.server_args import ServerArgs

    class P(argparse.ArgumentParser):
        def error(self, message):
            raise AssertionError(message)

    p = P(add_help=False)
    real_add = p.add_argument

    def prefixed(*names, **kw):
        longs = [n for n in names if n.startswith("--")]
        dest = kw.get("dest") or longs[0][2:].replace("-", "_")
        if dest in SLIME_UNREGISTERED:
            return None
        kw["dest"] = "sglang_" + dest
        return real_add(*["--sglang-" + n[2:] for n in longs], **kw)

    p.add_argument = prefixed
    ServerArgs.add_cli_args(p)
    p.add_argument = real_add
    for flag, nargs in SLIME_FLAGS_STANDIN.items():
        if nargs == 0:
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, nargs=nargs if nargs == "+" else None)
    return p


@needs_sglang
@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_sglang_args_parse_with_sglang_parser(path):
    from training_configs.derive import parse_sglang_flags
    cfg = load_config(path)
    for g in cfg.engine_groups:
        ns = parse_sglang_flags(sglang_args(cfg, g))
        for name, value in server_fields(cfg, g).items():
            assert getattr(ns, name) == value, (name, getattr(ns, name), value)


@needs_sglang
@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.rsplit("/", 1)[-1])
def test_slime_args_parse_like_slime(path):
    cfg = load_config(path)
    p = _slime_like_parser()
    for mode in ("plugin", "managed"):
        argv = slime_args(cfg, mode)
        ours = [a for a in argv if a.startswith("--") and (a.startswith("--sglang-") or a in SLIME_FLAGS_STANDIN)]
        ns, rest = p.parse_known_args(argv)  # the rest: Megatron/slime training flags, not SGLang's
        assert all(not r.startswith("--sglang-") for r in rest), rest
        assert ours
        g = cfg.engine_groups[0]
        assert int(ns.rollout_num_gpus_per_engine) == g.gpus_per_engine
        assert ns.use_rollout_routing_replay == g.routed_experts
        assert ns.sglang_dp_size == g.dp and ns.sglang_enable_dp_attention == g.enable_dp_attention
        if g.speculative:
            assert ns.sglang_speculative_num_draft_tokens == g.speculative.num_draft_tokens
        if mode == "managed":
            assert ns.rollout_external_engine_addrs == external_addrs(cfg)
            assert ns.rollout_function_path is None
        else:
            assert ns.rollout_function_path == ADAPTER_ROLLOUT_FN
        # slime rejects flags for the fields it sets itself
        assert not any(a in argv for a in ("--sglang-tp-size", "--sglang-enable-return-routed-experts",
                                           "--sglang-model-path"))


def test_seed_slime_args_match_slimes_glm45_script():
    cfg = load_config(shipped_configs()[0])
    assert cfg.name == "glm4.5-355b-a32b"
    s = " ".join(slime_args(cfg, "plugin"))
    for part in ("--rollout-num-gpus-per-engine 32", "--sglang-mem-fraction-static 0.7", "--sglang-enable-dp-attention",
                 "--sglang-dp-size 4", "--sglang-ep-size 32", "--sglang-enable-dp-lm-head",
                 "--sglang-moe-dense-tp-size 1", "--sglang-speculative-algorithm EAGLE",
                 "--sglang-speculative-num-steps 3", "--sglang-speculative-eagle-topk 1",
                 "--sglang-speculative-num-draft-tokens 4", "--use-rollout-routing-replay",
                 "--tensor-model-parallel-size 8", "--sequence-parallel", "--pipeline-model-parallel-size 4",
                 "--context-parallel-size 2", "--expert-model-parallel-size 16",
                 "--expert-tensor-parallel-size 1", "--max-tokens-per-gpu 16384", "--moe-enable-deepep",
                 "--custom-megatron-init-path rollout.routed_experts.slime_replay_padding.install"):
        assert part in s, part


def test_render_cli_formats(capsys):
    path = [p for p in shipped_configs() if p.endswith("tiny-cpu.yaml")][0]
    assert main(["config", "render", path, "--format", "external-addrs"]) == 0
    assert capsys.readouterr().out.split() == ["127.0.0.1:31400", "127.0.0.1:31410"]
    assert main(["config", "render", path, "--format", "sglang-args"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:2] == ["--model-path", ".cache/tiny-glm45"] and "--enable-return-routed-experts" in argv
    assert main(["config", "render", path, "--format", "slime-args", "--mode", "managed"]) == 0
    out = capsys.readouterr().out
    assert "--rollout-external-engine-addrs 127.0.0.1:31400 127.0.0.1:31410" in out
    assert main(["config", "render", path, "--format", "sglang-args", "--group", "nope"]) == 2
    assert "no engine group named 'nope'" in capsys.readouterr().err
