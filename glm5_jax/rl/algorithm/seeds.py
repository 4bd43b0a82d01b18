"""Seeds derived from integer parts, so that everything random in a run replays from its seed.

  rng = np.random.default_rng(seed_of(config.seed, step, 3))   # (seed, step, purpose)

Both RL loops and the rollout workers draw every random choice (prompts, sampling noise,
minibatch order, refill copies, injected faults) from a seed derived this way: a killed and
restarted run derives the same seeds for the same (step, purpose).
"""

from __future__ import annotations

import numpy as np


def seed_of(*parts) -> int:
  """A 31-bit seed derived from integer parts (seed, step, purpose, ...)."""
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] % 2**31)
