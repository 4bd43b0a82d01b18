"""Device mesh and the logical-axis rules table (docs/design.md decisions 1-2).

Mesh axes are `data, fsdp, context, expert, tensor`; sizes come from the config with
one -1 meaning "the rest of the devices". Every parameter carries logical axis
names; `DEFAULT_RULES` maps them to mesh axes, and `param_shardings` turns the
model's logical partition specs into `NamedSharding`s for `jax.jit`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")            # the global batch is split over these
TENSOR_AXIS = "tensor"                               # heads (and MLP widths)
TOKEN_AXES = BATCH_AXES + ("context",)             # [b * t] flattened tokens: batch, then
                                                   # sequence (nn/context_parallel.py)

# (logical name, mesh axes). First match wins (flax `logical_to_mesh_axes`).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("activation_batch", BATCH_AXES),
    ("activation_length", "context"),
    ("activation_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("index_heads", "tensor"),
    ("mlp", "tensor"),
    ("moe_mlp", "tensor"),
    ("expert", "expert"),
    ("q_lora", None),
    ("kv_lora", None),
    ("kv_lora_rope", None),
    ("qk_head_dim", None),
    ("qk_nope_head_dim", None),
    ("v_head_dim", None),
    ("index_head_dim", None),
    ("router_experts", None),
    ("mtp_concat", None),
    ("norm", None),
    ("layers", None),                                # the scanned layer stack (layer_stack.py)
)


def mesh_shape(sizes: dict[str, int], n_devices: int) -> tuple[int, ...]:
  """Resolves one -1 in `sizes` (keyed by MESH_AXES) against the device count."""
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"config.mesh has unknown axes {unknown}; expected {MESH_AXES}")
  shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
  free = [i for i, s in enumerate(shape) if s == -1]
  if len(free) > 1:
    raise ValueError(f"config.mesh={dict(zip(MESH_AXES, shape))}: at most one axis may be -1")
  if any(s < 1 and s != -1 for s in shape):
    raise ValueError(f"config.mesh={dict(zip(MESH_AXES, shape))}: sizes must be >= 1 or -1")
  known = math.prod(s for s in shape if s != -1)
  if free:
    if n_devices % known:
      raise ValueError(f"config.mesh={dict(zip(MESH_AXES, shape))}: {n_devices} devices are not "
                       f"divisible by the fixed axes' product {known}")
    shape[free[0]] = n_devices // known
  if math.prod(shape) != n_devices:
    raise ValueError(f"config.mesh={dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} "
                     f"devices, but {n_devices} are available")
  return tuple(shape)


def make_mesh(sizes: dict[str, int], devices: Sequence[Any] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(sizes, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def rules_from_config(rules) -> tuple[tuple[str, Any], ...]:
  if rules is None:
    return DEFAULT_RULES
  return tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in rules)


def param_shardings(logical_specs, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedSharding tree from the model's logical PartitionSpec tree."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, list(rules))


def check_divisible(shapes, shardings, mesh: Mesh) -> None:
  """Raises a ValueError naming every parameter dim its mesh axes do not divide."""
  problems = []
  flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
  flat_sh = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for (path, s), sh in zip(flat_shapes, flat_sh):
    for dim, axes in zip(s.shape, tuple(sh.spec) + (None,) * (len(s.shape) - len(sh.spec))):
      if axes is None:
        continue
      axes = axes if isinstance(axes, tuple) else (axes,)
      size = math.prod(mesh.shape[a] for a in axes)
      if dim % size:
        problems.append(f"{jax.tree_util.keystr(path)} dim {dim} over mesh axes {axes} "
                        f"(size {size})")
  if problems:
    raise ValueError("the mesh does not divide these parameters (change config.mesh or the "
                     "model): " + "; ".join(problems[:10]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of [batch, seq] inputs: batch over data, fsdp and expert."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def or_one_device(mesh: Mesh, sharding):
  """`sharding`, or the mesh's device itself when the mesh has one device: a program over one
  device then compiles as a plain single-device program (no SPMD partitioning), exactly as
  an unsharded jit or an engine on that device does. Not under jax.distributed: orbax
  saves no single-device array there (a trainer alone in its cluster keeps a 1-device mesh)."""
  if mesh.size == 1 and jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
  return sharding


def from_host(x, sharding):
  """A global array in `sharding` from a host array that every process holds whole: each
  process places only the slices its own devices hold (works on one or many processes)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(tree):
  """numpy values of a tree of arrays, each whole on every process: a global array whose
  shards live on other processes' devices is all-gathered (a collective: every process calls
  this in the same order, as every process runs the same program); anything else is read
  from this process's devices."""
  def one(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return None if x is None else np.asarray(x)
  return jax.tree.map(one, tree)


def batch_axis_size(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)



def active_mesh():
  """The mesh set with `jax.set_mesh`, or None (no mesh, or a single device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.shape.values()) == 1:
    return None
  return mesh


def axes_dividing(mesh, axes, n: int):
  """The axes of `axes` present in `mesh` if their product divides n, else None."""
  axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
  if not axes or n % math.prod(mesh.shape[a] for a in axes):
    return None
  return axes
