"""The RL loops and the system that runs them: synchronous GRPO, asynchronous agentic RL,
rollout workers, routing, staleness, the ledger, heartbeats, weight pushes and backends.

Imports `glm5_jax.rl.envs` and `glm5_jax.rl.algorithm` (glm5_jax/rl/__init__.py draws the
levels).
"""
