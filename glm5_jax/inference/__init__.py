"""Inference: KV-cached generation with exact log-probs and MTP speculative decoding.

    from glm5_jax.inference import Engine, SamplingParams
    engine = Engine(cfg, params, max_batch=8, max_len=4096)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16, seed=0))
"""

from glm5_jax.inference.engine import Engine
from glm5_jax.inference.engine import GenerationOutput
from glm5_jax.inference.sampling import SamplingParams

__all__ = ["Engine", "GenerationOutput", "SamplingParams"]
