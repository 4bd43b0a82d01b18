"""glm5-jax: the GLM-5 model and training recipe in JAX / Flax."""

from glm5_jax.config import ModelConfig
from glm5_jax.config import get_preset

__all__ = ["ModelConfig", "get_preset"]
__version__ = "0.1.0"
