"""`config render --format slime-args --mode plugin` carries the config's partial rollout to slime: plugin mode
reads slime's `--partial-rollout` (without it stragglers restart from their prompt), and slime's
`--mask-offpolicy-in-partial-rollout` (given in slime.extra_args) is refused without it."""
import pytest

from training_configs.render import slime_args
from training_configs.schema import ConfigError, load_config, shipped_configs

pytestmark = pytest.mark.timeout(60)


def _tiny():
    return load_config([p for p in shipped_configs() if p.endswith("tiny-cpu.yaml")][0])


def test_plugin_mode_renders_partial_rollout_when_the_config_asks():
    cfg = _tiny()
    assert cfg.rollout.partial_rollout is True   # the schema's default
    argv = slime_args(cfg, "plugin")
    assert argv.count("--partial-rollout") == 1
    cfg.rollout.partial_rollout = False
    assert "--partial-rollout" not in slime_args(cfg, "plugin")
    assert "--partial-rollout" not in slime_args(_tiny(), "managed")   # slime's own rollout: the user's flags


def test_mask_flag_is_rendered_once_with_partial_rollout_and_refused_without():
    cfg = _tiny()
    cfg.slime.extra_args["mask_offpolicy_in_partial_rollout"] = True
    argv = slime_args(cfg, "plugin")
    assert argv.count("--partial-rollout") == 1 and argv.count("--mask-offpolicy-in-partial-rollout") == 1
    cfg.rollout.partial_rollout = False
    with pytest.raises(ConfigError, match="mask_offpolicy_in_partial_rollout needs rollout.partial_rollout: true"):
        slime_args(cfg, "plugin")
