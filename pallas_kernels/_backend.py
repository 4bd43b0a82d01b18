"""Backend choice and small helpers shared by the Pallas kernels.

Each op has a TPU lowering (Mosaic, `tpu.py`) and a GPU lowering (Pallas
Triton, `gpu.py`). `dispatch` picks one:

  backend="tpu" | "gpu"   that lowering, whatever the platform (tests, export).
  backend=None, interpret the lowering of the default backend ("gpu" on a GPU
                          host, else "tpu"), run by the Pallas interpreter.
  backend=None            `lax.platform_dependent`: the lowering platform picks
                          the kernel, so `jax.export(..., platforms=["tpu"])`
                          from a CPU host gets the TPU kernel and
                          `platforms=["cuda"]` the Triton one.
  interpret=None          also by lowering platform: the kernel on TPU / CUDA,
                          the Triton lowering's interpreter on any other platform
                          (plain jax; the TPU interpreter's io_callbacks are
                          ordered effects that `platform_dependent` cannot put
                          next to effect-free branches, so backend="tpu" is
                          refused here). What the model uses: the same
                          jitted code runs on a CPU host and compiles for a TPU
                          from it.

Interpret mode for the TPU kernels uses `pltpu.InterpretParams()`, which
simulates HBM, VMEM, SMEM, DMAs and semaphores (DMAs land only when waited on,
fresh scratch is NaN, out-of-bounds reads raise), so a missing wait or a read of
an unwritten buffer shows up on CPU. The Triton kernels use the generic
interpreter (`interpret=True`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BACKENDS = ("tpu", "gpu")


def check_backend(backend: str | None, where: str):
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"{where}: backend={backend!r}, expected None or one of {BACKENDS}")


def check_axes(where: str, **arrays) -> dict[str, int]:
  """Checks named axes, e.g. check_axes("f", q=(q, "b t h d"), kv=(kv, "b s d")) -> {axis: size}.

  Raises a ValueError, naming every array's shape and its expected axes, when an
  array's rank differs from its axis count or one axis name gets two sizes.
  """
  sizes = {}
  for x, axes in arrays.values():
    names = axes.split()
    if x.ndim != len(names) or any(sizes.setdefault(a, n) != n for a, n in zip(names, x.shape)):
      want = ", ".join(f"{name} [{','.join(ax.split())}]" for name, (_, ax) in arrays.items())
      got = " ".join(f"{name}{a.shape}" for name, (a, _) in arrays.items())
      raise ValueError(f"{where} expects {want} (one size per axis name); got {got}")
  return sizes


_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}


def dispatch(make: Callable[[str, Any], Callable[..., Any]], backend: str | None,
             interpret: Any, *args):
  """Calls make(backend, interpret)(*args) as described in the module docstring."""
  if interpret is None:
    if backend == "tpu":
      raise ValueError("interpret=None needs backend=None or 'gpu': the TPU interpreter's "
                       "io_callbacks cannot be a platform_dependent branch")
    names = BACKENDS if backend is None else (backend,)
    kernels = {_PLATFORM[name]: make(name, False) for name in names}
    return jax.lax.platform_dependent(*args, **kernels, default=make("gpu", True))
  if backend is None and interpret:
    backend = "gpu" if jax.default_backend() == "gpu" else "tpu"
  if backend is not None:
    return make(backend, interpret)(*args)
  return jax.lax.platform_dependent(*args, tpu=make("tpu", interpret),
                                    cuda=make("gpu", interpret))


def tpu_interpret(interpret: Any):
  """The `interpret=` argument for a TPU pallas_call: True -> InterpretParams()."""
  if interpret is True:
    return pltpu.InterpretParams()
  return interpret


def gpu_interpret(interpret: Any) -> bool:
  return bool(interpret)


def pad_to(x, axis: int, multiple: int, value=0):
  """Pads `x` at the end of `axis` to a multiple of `multiple` with `value`."""
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def next_pow2(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum) (Triton block dims are powers of two)."""
  n = max(n, minimum)
  return 1 << (n - 1).bit_length()


def nt_dot(a, b, precision):
  """a [m, c] . b [n, c]^T -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def nn_dot(a, b, precision):
  """a [m, c] . b [c, n] -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def tn_dot(a, b, precision):
  """a [c, m]^T . b [c, n] -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def dot_precision(dtype):
  """HIGHEST for float32 operands (no TF32 / bf16 passes), DEFAULT otherwise."""
  if jnp.dtype(dtype) == jnp.float32:
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def index_scores_tile(live, q_ref, k_ref, w_column, o_ref, *, precision):
  """Body of both lightning-indexer score kernels (`lightning_indexer/{tpu,gpu}.py`).

  Live tile: o [tq, bk] = sum_j w_column(j) * relu(q_j [tq, d] . k^T [d, bk]) in float32,
  q_ref [h_i, tq, d], k_ref [bk, d], w_column(j) the [tq, 1] weights of head j (each
  backend slices its w block its own way). Causal-dead tile: -inf, nothing loaded.
  """
  @pl.when(live)
  def _compute():
    k = k_ref[...]                                              # [bk, d]
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(q_ref.shape[0]):
      qk = nt_dot(q_ref[j], k, precision)                       # [tq, bk]
      acc = acc + w_column(j) * jnp.maximum(qk, 0.0)
    o_ref[...] = acc

  @pl.when(jnp.logical_not(live))
  def _dead():
    o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)
