"""Trainer batches from trajectories: their padded length, device arrays and minibatch rows.

Both RL loops hand the runner's `train_step` the same fields (`FIELDS`, plus `routing` under
rollout routing replay): `trajectory.make_batch` pads the trajectories to `padded_length`,
`device_batch` places the fields on the trainer's mesh, `take_rows` gathers a minibatch;
`batch_of` is the asynchronous loop's batch of finished groups, each rollout with its
group-relative advantage.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import sharding as shd
from glm5_jax.rl.algorithm import groups as groups_lib
from glm5_jax.rl.algorithm import trajectory as traj_lib

FIELDS = ("tokens", "positions", "segment_ids", "loss_mask", "rollout_logp", "advantages")


def device_batch(b: traj_lib.TrajectoryBatch, sharding=None, replay: bool = False) -> dict:
  """The fields of `b` a trainer step reads, as device arrays (global arrays in `sharding`,
  every process holding the whole batch; None: the default device). `replay`: also the
  engine's routing records (`routing`, rollout routing replay)."""
  fields = FIELDS + (("routing",) if replay and b.routing is not None else ())
  if sharding is None:
    return {k: jnp.asarray(getattr(b, k)) for k in fields}
  return {k: shd.from_host(getattr(b, k), sharding) for k in fields}


def has_moe(cfg) -> bool:
  """Whether the model has MoE layers (whose routing the engine records)."""
  return any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


@functools.partial(jax.jit, static_argnums=2)
def _take_rows(tree, idx, sharding):
  return jax.tree.map(lambda v: jax.lax.with_sharding_constraint(v[idx], sharding), tree)


def take_rows(tree, idx, sharding=None):
  """Rows `idx` (host ints, the same on every process) of every array of `tree`, on the
  devices: a global gather into `sharding` under a mesh (rows on other processes' devices
  included), a plain gather on the default device without one."""
  if sharding is None:
    return {k: v[jnp.asarray(idx)] for k, v in tree.items()}
  return _take_rows(tree, np.asarray(idx, np.int32), sharding)


def padded_length(n: int, context: int) -> int:
  """A batch length for `n` tokens: the power-of-two bucket, a multiple of 2 * context."""
  t = traj_lib.bucket_length(n)
  return t if context == 1 else -(-t // (2 * context)) * (2 * context)


def batch_of(groups, normalize_std: bool, rows_multiple: int = 1, context: int = 1):
  """(TrajectoryBatch, segment list) of the segments of `groups`, each carrying its rollout's
  group-relative advantage. Rows are padded to a power of two (rounded up to a multiple of
  `rows_multiple`, the mesh's batch axes) by copies of row 0 without loss, so few distinct
  shapes compile; the length to its bucket, a multiple of 2 * `context`."""
  segs, advs = [], []
  for g in groups:
    for rollout, a in zip(g.rollouts, groups_lib.advantages(g.rollouts, normalize_std)):
      for seg in rollout:
        segs.append(seg)
        advs.append(a)
  n = -(-traj_lib.bucket_length(len(segs), minimum=1) // rows_multiple) * rows_multiple
  pad = n - len(segs)
  length = padded_length(max(s.length for s in segs), context)
  batch = traj_lib.make_batch(segs + [segs[0]] * pad, advs + [0.0] * pad, length=length)
  if pad:
    batch.loss_mask[len(segs):] = 0.0
    batch.versions[len(segs):] = -1
  return batch, segs
