"""weight-update-pause on every reviewed release: SGLang's own pause, flush and /update_weight_version code on slime's
update sequence (sglang_patches/scenarios/weight_update.py, run with every scenario list in one interpreter per
release). Stock SGLang aborts every request in flight at the empty-body pause and at /update_weight_version, and
before 0.5.21 refuses the flush while retracted requests wait; with the plugin none of them happens."""
import os
from types import SimpleNamespace

import pytest
from support.variant_runs import scenarios

from sglang_patches.fixes import weight_update_pause as wup
from sglang_patches.registry import VARIANTS
from sglang_patches.scenarios import weight_update

RELEASES = [v.name for v in VARIANTS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", RELEASES)
def test_weight_update_pause_on_variant(variant):
    res = scenarios(variant)
    assert wup.FIX.name in res["plugin"]["_meta"]["registered"]
    for name, (needle, plugin_ok) in weight_update.expected(variant).items():
        stock, fixed = res["none"][name], res["plugin"][name]
        if needle is None:
            assert stock["ok"], f"{name} on stock {variant}: {stock['detail']}"
        else:
            assert not stock["ok"] and needle in stock["detail"], f"{name} on stock {variant}: {stock['detail']}"
        assert fixed["ok"] == plugin_ok, f"{name} with the plugin on {variant}: {fixed['detail']} " \
                                         f"{fixed.get('trace', '')}"


def test_flush_hooked_exactly_before_0_5_21():
    """The flush hook where SGLang's flush refuses with retracted requests waiting (no `ignore_waiting`): 0.5.15.post1
    to 0.5.20; 0.5.21+ flush a paused engine themselves."""
    from sglang_patches.registry import table

    hooked = {v.name for v in VARIANTS if wup.FLUSH in {h.target for h in table(v.table)["weight-update-pause"].hooks}}
    assert hooked == {"0.5.15.post1", "0.5.15.post1+slime", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20"}


@pytest.mark.parametrize("env, routed, want", [
    (None, True, "retract"), (None, False, "abort"), ("abort", True, "abort"), ("retract", False, "retract"),
    ("bogus", True, "retract"),
])
def test_pause_mode(monkeypatch, env, routed, want):
    if env is None:
        monkeypatch.delenv(wup.ENV, raising=False)
    else:
        monkeypatch.setenv(wup.ENV, env)
    assert wup.pause_mode(SimpleNamespace(enable_return_routed_experts=routed)) == want


def test_flush_hook_restores_the_queue_when_the_flush_raises():
    queue = [object(), object()]
    held = list(queue)
    sched = SimpleNamespace(waiting_queue=queue, _engine_paused=True)

    def boom(self, *a, **k):
        assert self.waiting_queue == []
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        wup.flush_while_paused(boom, sched)
    assert sched.waiting_queue is queue and queue == held


def test_other_aborts_pass(monkeypatch):
    """Only the abort-all of SGLang's /update_weight_version handler is dropped: a direct abort-all passes."""
    monkeypatch.setenv(wup.ENV, "retract")
    sent = []
    tm = SimpleNamespace(server_args=SimpleNamespace())
    wup.keep_on_version_abort(lambda self, *a, **k: sent.append(k), tm, abort_all=True)
    assert sent == [{"abort_all": True}]
    assert os.environ[wup.ENV] == "retract"


def test_config_key_reaches_every_engine():
    """rollout.weight_update_pause becomes the plugin's switch in every engine group's environment; a group env
    that says otherwise is a one-line config error."""
    import yaml

    from training_configs.schema import TrainingConfig

    with open(os.path.join(os.path.dirname(__file__), "..", "training_configs", "tiny-cpu-r3.yaml")) as f:
        raw = yaml.safe_load(f)
    assert all(wup.ENV not in g.env for g in TrainingConfig.model_validate(raw).engine_groups)   # unset: the default
    raw["rollout"]["weight_update_pause"] = "abort"
    assert [g.env[wup.ENV] for g in TrainingConfig.model_validate(raw).engine_groups] == ["abort"]
    raw["engine_groups"][0].setdefault("env", {})[wup.ENV] = "retract"
    with pytest.raises(ValueError, match=f"env.{wup.ENV}: 'retract' contradicts rollout.weight_update_pause 'abort'"):
        TrainingConfig.model_validate(raw)
