"""Admission reads the fix report of a real SGLang CPU engine (tiny GLM-4.5, preset a without routed experts,
SGLang of the main environment) started as unreviewed (`SLIME_MOE_ROLLOUT_REVIEW_AS=0.0.0`: the plugin loads,
hooks nothing and reports why): readiness refuses it in one line and `rollout.allow_unfixed` admits it; in plugin
mode, the same engine behind slime's router (the discovery STAND-IN of test_slime_adapter.py) stops the attach
in one line and `SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1` attaches and generates. Routed experts are off because
without `routed-experts-rows` the CPU engine dies at /health_generate."""
import asyncio

import pytest
from support.engines import budgets, preset
from test_slime_adapter import StandInDataSource, StandInRouter, _args

from rollout.engines.client import EngineClient
from rollout.engines.local_backend import LocalBackend
from rollout.engines.readiness import ReadinessError, wait_ready
from rollout.slime import adapter as slime_adapter

pytestmark = [pytest.mark.slow, pytest.mark.e2e]   # one engine start (40-70 s on 2 shared cores)
UNREVIEWED = "SGLang 0.5.23: no fixes applied: SLIME_MOE_ROLLOUT_REVIEW_AS=0.0.0 is not a reviewed variant"


def _admit(engine, allow: bool):
    b = budgets()

    async def run():
        async with EngineClient() as client:
            return await wait_ready(engine, b, client, allow_unfixed=allow)
    return asyncio.run(run())


@pytest.mark.timeout(900)
def test_an_unreviewed_engine_is_refused_at_admission_and_the_switches_admit_it(tiny_model, tmp_path, capfd,
                                                                                 monkeypatch):
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_ALLOW_UNFIXED", raising=False)
    monkeypatch.delenv("SLIME_MOE_ROLLOUT_CONFIG", raising=False)
    spec = preset("a", tiny_model, routed_experts=False, env={"SLIME_MOE_ROLLOUT_REVIEW_AS": "0.0.0"})
    engine = LocalBackend(str(tmp_path)).start(spec)
    router = None
    try:
        with pytest.raises(ReadinessError) as e:
            _admit(engine, allow=False)
        assert str(e.value).splitlines()[0].startswith(
            f"engine {engine.name}: phase 'fix report' failed (budget 0 s): refused: {UNREVIEWED} "
            "(set rollout.allow_unfixed: true to run it anyway)")
        assert engine.alive()
        capfd.readouterr()
        _admit(engine, allow=True)
        said = [ln for ln in capfd.readouterr().err.splitlines() if "WITHOUT" in ln]
        assert said == [f"{engine.name}: admitted WITHOUT its fixes (rollout.allow_unfixed: true): {UNREVIEWED}"]

        router = StandInRouter([(engine.url, "regular")]).start()
        args = _args(router.port, sglang_api_key=engine.api_key, use_rollout_routing_replay=False,
                     rollout_batch_size=1)
        slime_adapter.reset()
        slime_adapter.set_tokenizer(None)
        with pytest.raises(ReadinessError) as e:
            slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2, 3]], 2))
        assert str(e.value).splitlines() == [
            f"engine {engine.url}: phase 'fix report' failed (budget 0 s): refused: {UNREVIEWED} "
            "(set SLIME_MOE_ROLLOUT_ALLOW_UNFIXED=1 to run it anyway)"]
        slime_adapter.reset()
        slime_adapter.set_tokenizer(None)
        monkeypatch.setenv("SLIME_MOE_ROLLOUT_ALLOW_UNFIXED", "1")
        out = slime_adapter.generate_rollout(args, 0, StandInDataSource([[1, 2, 3]], 2))
        assert len(out.samples) == 1 and all(s.response_length > 0 for s in out.samples[0])
    finally:
        slime_adapter.reset()
        if router is not None:
            router.stop()
        engine.stop()
