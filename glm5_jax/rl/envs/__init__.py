"""What the policy acts in: tasks, rewards, tools, the sandbox, single- and multi-turn rollouts.

Imports `glm5_jax.rl.algorithm` only (glm5_jax/rl/__init__.py draws the levels).
"""
