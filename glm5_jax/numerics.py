"""Batch-invariant numerics on CPU, so that the rollout engine and the trainer agree bitwise.

GLM-5's RL lesson (paper §3): the trainer and the rollout engine must compute the same
log-probs; slime gates GLM-5 runs at |train - rollout| < 1e-6, which takes kernels whose
result for one row does not depend on how many other rows share the call ("batch
invariance"; Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).

On CPU, jaxlib 0.10's XLA sends dots to YNNPACK fusions whose summation order depends on the
number of rows: one row of a [64, 64] @ [64, 32] float32 matmul differs by 1.4e-6 between a
batch of 1 and of 64. The engine decodes one row per request while the trainer runs whole
sequences, so on the main job's trained tiny model their log-probs differed by up to 4e-6,
and the trainer's own log-probs moved by 1.7e-6 when its padding changed from 32 to 64.
With YNNPACK fusions off, XLA:CPU's dots go to Eigen, which is row-invariant at these
shapes: engine and trainer log-probs are then bitwise equal (tests/rl/test_grpo.py).
Speed is about the same (tiny train step 0.47 -> 0.57 s, small 15.2 -> 13.3 s here).
Even with Eigen, a matmul of fewer than 8 rows may sum a row in another order than the same
row in a larger matmul (Eigen's contraction then splits the summed dimension across
threads or takes its matrix-vector kernel; shape-dependent): on this project's 2-core VM a
[M, 1536] @ [1536, 512] row matched the 4096-row result for M >= 8 but not for M = 2 .. 7
(so did [M, 256] @ [256, 32768]); on the `small` preset, whose dense FFN is 1536 wide, a
lone request padded to 2 lanes differed from the trainer by 1.9e-6 in its log-probs, 4
lanes by 9.5e-7, 8 or more lanes not at all. The engine therefore pads each device call to
`MIN_INVARIANT_ROWS` tokens (`inference.engine.invariant_tokens`,
`Engine(batch_invariant=True)`). The MoE's CPU kernels (`nn/ffn.py` `blocked_swiglu`,
`looped_swiglu`) compute every row in blocks of at least 8 rows: row-invariant at every
token count.

The flag is read when JAX creates its CPU backend, so `batch_invariant_cpu()` must run
before the first computation; the RL entry points, the main job and the tests call it at
import. Accelerators are unaffected (the flag names an XLA:CPU fusion).
"""

from __future__ import annotations

import os

FLAG = "--xla_cpu_experimental_ynn_fusion_type="
MIN_INVARIANT_ROWS = 8          # fewest rows of a matmul whose rows are batch-invariant (above)
DEVICES_FLAG = "--xla_force_host_platform_device_count="


def is_set() -> bool:
  return FLAG in os.environ.get("XLA_FLAGS", "").split()


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(getattr(xla_bridge, "_backends", {}))
  except ImportError:
    return False


def batch_invariant_cpu() -> None:
  """Adds FLAG to XLA_FLAGS; raises if JAX already created its backends without it."""
  if is_set():
    return
  if _backends_started():
    raise RuntimeError(
        "glm5_jax.numerics.batch_invariant_cpu() must run before JAX's first computation "
        f"(the CPU backend reads XLA_FLAGS once); set XLA_FLAGS='{FLAG}' in the environment "
        "or call it first thing")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()


def cpu_devices(n: int) -> None:
  """Asks XLA:CPU for n (fake) devices before JAX starts, so that a CPU machine splits into a
  trainer's device and RL rollout workers' devices. A count already in XLA_FLAGS wins."""
  flags = os.environ.get("XLA_FLAGS", "")
  if DEVICES_FLAG in flags:
    return
  if _backends_started():
    raise RuntimeError(f"glm5_jax.numerics.cpu_devices({n}) must run before JAX's first "
                       f"computation; set XLA_FLAGS='{DEVICES_FLAG}{n}' in the environment")
  os.environ["XLA_FLAGS"] = (flags + f" {DEVICES_FLAG}{int(n)}").strip()
