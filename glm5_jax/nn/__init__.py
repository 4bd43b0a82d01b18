"""Flax Linen modules of GLM-5 (docs/design.md §4: one concern per file)."""

from glm5_jax.nn.model import GLM5
from glm5_jax.nn.model import ModelOutput
from glm5_jax.nn.model import abstract_params
from glm5_jax.nn.model import init_params

__all__ = ["GLM5", "ModelOutput", "abstract_params", "init_params"]
