"""Training: train state and step, the loop, orbax checkpoints, metrics.

`run` is imported on first use, so that the optimizer-free parts (`flops`,
`stages`) import without optax, orbax or grain.
"""


def __getattr__(name):
  if name == "run":
    from glm5_jax.train.loop import run  # pylint: disable=g-import-not-at-top
    return run
  raise AttributeError(f"module 'glm5_jax.train' has no attribute {name!r}")


__all__ = ["run"]
