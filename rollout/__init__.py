"""Rollout side: engines, readiness, dispatch, streaming, routed experts, slime adapter."""
