"""Wall-clock timing for benchmark scripts and run metrics (not for tests)."""

from __future__ import annotations

import threading
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


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile = {"s": 0.0, "n": 0, "listening": False}
_compile_lock = threading.Lock()


def _on_event(name: str, secs: float, **_):
  if name in _COMPILE_EVENTS:
    with _compile_lock:
      _compile["s"] += secs
      _compile["n"] += name.endswith("backend_compile_duration")


def compile_seconds() -> tuple[float, int]:
  """(seconds, count) of JAX compilation (tracing, lowering, XLA) in this process since the
  first call: a long run reports it, so time spent compiling new shapes is not mistaken for
  steady-state speed. Compilations on other threads count too; they overlap wall-clock."""
  with _compile_lock:
    if not _compile["listening"]:
      jax.monitoring.register_event_duration_secs_listener(_on_event)
      _compile["listening"] = True
    return _compile["s"], _compile["n"]
