"""Plugin mode admits slime's own SGLang workers by the fix report in their `/server_info`, as readiness
admits the main job's engines (`readiness.fix_refusal`): a worker whose needed fix is not good, or one
without the report (the plugin not loaded there), stops the attach with one line naming the worker and
the reason; `SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1`, or `rollout.allow_unfixed: true` in the YAML named by
`SLIME_MOE_ROLLOUT_CONFIG`, attaches anyway and says so. The router and workers are the STAND-INs of
tests/test_slime_adapter.py (the fake SGLang server serves a good report by default)."""
import pytest
import yaml
from support.fake_sglang import REPORT_KEY
from test_slime_adapter import StandInRouter, StandInWorker, _args

from rollout.engines.readiness import ReadinessError
from rollout.slime import adapter as slime_adapter

BAD = {"sglang_version": "0.5.23", "refusal": None, "fixes": [
    {"name": "routed-experts-rows", "state": "disabled", "needed": True, "good": False,
     "reason": "disabled by SLIME_MOE_ROLLOUT_DISABLE"}]}


@pytest.fixture
def workers(monkeypatch):
    """slime's router listing a good worker and one the test spoils; the override env unset."""
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_ALLOW_UNFIXED", raising=False)
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_CONFIG", raising=False)
    good, bad = StandInWorker().start(), StandInWorker().start()
    router = StandInRouter([(good.url, "regular"), (bad.url, "regular")]).start()
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)   # prompts arrive as tokens
    yield router, good, bad
    slime_adapter.reset()
    for srv in (router, good, bad):
        srv.stop()


def _rollout(router, **kw):
    from test_slime_adapter import StandInDataSource
    return slime_adapter.generate_rollout(_args(router.port, rollout_batch_size=2, **kw), 0,
                                          StandInDataSource([[1, 2], [3, 4]], 2))


def _refusal(router, **kw) -> str:
    with pytest.raises(ReadinessError) as e:
        _rollout(router, **kw)
    lines = str(e.value).splitlines()
    assert len(lines) == 1
    return lines[0]


def test_a_worker_with_a_needed_fix_disabled_is_refused_in_one_line(workers):
    router, good, bad = workers
    bad.server_info["internal_states"] = [{REPORT_KEY: BAD}]
    assert _refusal(router) == (
        f"engine {bad.url}: phase 'fix report' failed (budget 0 s): refused: needed fixes not active: "
        "routed-experts-rows disabled (disabled by SLIME_MOE_ROLLOUT_DISABLE) "
        "(set SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1 to run it anyway)")
    assert good.requests == bad.requests == []   # nothing was generated


def test_a_worker_without_the_report_is_refused(workers):
    """The recorded /server_info of SGLang 0.5.23 (tests/facts): what an engine without the plugin answers."""
    router, good, bad = workers
    del bad.server_info["internal_states"]
    line = _refusal(router)
    assert line.startswith(f"engine {bad.url}: phase 'fix report' failed (budget 0 s): refused: no slime-moe-rollout "
                           "fix report in /server_info: the plugin is not loaded in the engine")
    assert line.endswith("(set SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1 to run it anyway)")


def test_the_env_override_attaches_and_says_so(workers, monkeypatch, capfd):
    router, good, bad = workers
    bad.server_info["internal_states"] = [{REPORT_KEY: BAD}]
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_ALLOW_UNFIXED", "1")
    out = _rollout(router)
    assert len(out.samples) == 2 and bad.requests and good.requests   # both workers sent to
    said = [ln for ln in capfd.readouterr().err.splitlines() if "WITHOUT" in ln]
    assert said == [f"worker {bad.url}: admitted WITHOUT its fixes (SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1): "
                    "needed fixes not active: routed-experts-rows disabled (disabled by SLIME_MOE_ROLLOUT_DISABLE)"]


def test_the_config_key_overrides_when_a_config_is_named(workers, monkeypatch, tmp_path, capfd):
    from support import ROOT
    router, good, bad = workers
    del bad.server_info["internal_states"]
    cfg = yaml.safe_load((ROOT / "training_configs" / "tiny-cpu.yaml").read_text())
    path = tmp_path / "cfg.yaml"
    monkeypatch.setenv("SLIME_MOE_ROLLOUT_CONFIG", str(path))
    path.write_text(yaml.safe_dump(cfg))
    no_r3 = {"use_rollout_routing_replay": False}   # the YAML's model is not the stand-ins' layout
    assert _refusal(router, **no_r3).endswith(f"(set rollout.allow_unfixed: true in {path} to run it anyway)")
    slime_adapter.reset()
    slime_adapter.set_tokenizer(None)
    cfg["rollout"]["allow_unfixed"] = True
    path.write_text(yaml.safe_dump(cfg))
    assert len(_rollout(router, **no_r3).samples) == 2
    said = [ln for ln in capfd.readouterr().err.splitlines() if "WITHOUT" in ln]
    assert said and said[0].startswith(f"worker {bad.url}: admitted WITHOUT its fixes "
                                       f"(rollout.allow_unfixed: true in {path}): no slime-moe-rollout fix report")


def test_a_worker_whose_server_info_fails_is_left_out_until_it_answers(workers):
    """A 500 from /server_info (a worker still starting or failing) neither admits nor refuses it: the step
    runs on the admitted worker, and the next listing reads it again."""
    from aiohttp import web
    router, good, bad = workers
    good_info = bad.routes["/server_info"]

    async def fails(request):
        return web.Response(status=500, text="starting")

    bad.routes["/server_info"] = fails
    assert len(_rollout(router).samples) == 2
    assert good.requests and bad.requests == []
    bad.routes["/server_info"] = good_info
    bad.server_info["internal_states"] = [{REPORT_KEY: BAD}]
    assert _refusal(router).startswith(f"engine {bad.url}: phase 'fix report' failed")   # read at the next step


def test_prefill_decode_workers_behind_the_router_are_checked_too(monkeypatch):
    """PD disaggregation sends through the router (only it pairs them): the workers it lists are admitted."""
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_ALLOW_UNFIXED", raising=False)
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_CONFIG", raising=False)
    prefill, decode = StandInWorker().start(), StandInWorker().start()
    decode.server_info["internal_states"] = [{REPORT_KEY: BAD}]
    router = StandInRouter([(prefill.url, "prefill"), (decode.url, "decode")]).start()
    try:
        slime_adapter.reset()
        slime_adapter.set_tokenizer(None)
        assert _refusal(router, use_rollout_routing_replay=False).startswith(
            f"engine {decode.url}: phase 'fix report' failed (budget 0 s): refused: needed fixes not active: "
            "routed-experts-rows disabled")
        assert router.requests == []
    finally:
        slime_adapter.reset()
        for srv in (router, prefill, decode):
            srv.stop()
