"""A wedged plain `--dp-size` replica on REAL SGLang CPU engines (the stand-in versions:
tests/test_health_replicas.py). Slow: starts two engines of two replicas each.

Two engines of the tiny GLM-4.5 (routed experts on), each `--dp-size 2` without DP attention (two
replicas of tp 1: `extra_sglang_args.dp_size`, what a config can ask for). Mid-rollout ONE replica's
scheduler is stopped (SIGSTOP). Its engine's other replica keeps serving, so SGLang's `/health_generate`
keeps passing (any replica's output answers it): before per-replica probes the monitor's history showed
only passing probes and the groups on the stopped replica hung to the request timeout. With them the
pinned probe of that replica fails, its engine is declared dead in one event line naming the replica,
and its groups finish on the other engine, each sample moved at most once, the group together.
"""
import pytest
from test_manager_engines import CONFIG, _config, assert_moved_once_together, stop_one_rank_mid_rollout

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
WINDOW_S, TIMEOUT_S, INTERVAL_S, FAILURES = 5, 5.0, 1.0, 2
DEAD_WITHIN_S = 180   # failures x (interval + probe timeout) is 12 s; the rest is a loaded 2-core machine


@pytest.mark.timeout(1500)
def test_wedged_replica_is_taken_out_its_groups_finish_elsewhere_once(tmp_path):
    cfg = _config(engines=2, max_new_tokens=96, path=CONFIG)
    g = cfg.engine_groups[0]
    g.extra_sglang_args["dp_size"] = 2               # plain replicas: no enable_dp_attention
    g.env["SGLANG_HEALTH_CHECK_TIMEOUT"] = str(WINDOW_S)
    cfg.rollout.health.interval_s, cfg.rollout.health.timeout_s, cfg.rollout.health.failures = \
        INTERVAL_S, TIMEOUT_S, FAILURES
    assert cfg.rollout.group_placement == "group" and not g.enable_dp_attention
    victim_name, other_name, stop_rank = "tiny-1", "tiny-0", 1

    def replicas(m):
        assert {n: (s.dp_ranks, s.replicas) for n, s in m.dispatcher.slots.items()} == \
            {victim_name: (2, True), other_name: (2, True)}

    res, groups, dead, _, at_stop, keys = stop_one_rank_mid_rollout(cfg, tmp_path, victim_name, stop_rank,
                                                                    DEAD_WITHIN_S, check_admitted=replicas)
    on_stopped = {sid for sid, k in at_stop.items() if k[1] == stop_rank}
    assert [e.engine for e in dead] == [victim_name], [str(e) for e in dead]
    assert "consecutive health probes failed (last: DP replica 1: no token within" in dead[0].detail \
        and "scheduler stopped" in dead[0].detail and "DP replica 0" not in dead[0].detail, dead[0].detail
    assert res.delivered == 8 and len({g.group_id for g in groups}) == 8 and res.failed_samples == 0
    assert all(s.status in ("completed", "truncated") and len(s.response_ids) == 96 for g in groups for s in g.samples)
    assert on_stopped and all(s.engine == other_name for g in groups for s in g.samples if s.sample_id in on_stopped)
    assert_moved_once_together(groups, keys, victim_name, other_name)
