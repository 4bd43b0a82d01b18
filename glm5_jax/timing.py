"""Wall-clock timing for benchmark scripts (not for tests)."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_time(fn, *args, repeats: int = 3) -> float:
  """Median seconds of `fn(*args)` over `repeats` runs, after one compile + warm-up run."""
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))
