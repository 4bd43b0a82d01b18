"""RL data and the method's bookkeeping: trajectories, groups, trainer batches, consistency.

Imports nothing else of `glm5_jax.rl` (glm5_jax/rl/__init__.py draws the levels).
"""
