"""Training: train state and step, the loop, orbax checkpoints, metrics."""

from glm5_jax.train.loop import run

__all__ = ["run"]
