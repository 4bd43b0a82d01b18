"""Failure filtering and group refill, then group-relative advantages (GLM-5 paper §3).

A group is the G rollouts drawn for one admission of a prompt; a rollout is the list of its
segments (`Trajectory`s sharing one rollout id, reward and status; a bare `Trajectory` counts
as a one-segment rollout). Environment failures (crashes, timeouts) and aborted rollouts keep
their status and are never trained on; a truncated rollout (cut off, out of context or of
turns: the policy's doing) is trained on with its reward, 0. GLM-5's rule for the group:

  1. valid = rollouts whose every segment has a status in `TRAINED` ("ok", "truncated").
  2. If more than half of the G rollouts are valid (2 * valid > G), the group is filled back
     to G with deep copies of valid rollouts: copy counts are spread evenly (any two sources
     differ by at most one copy), which sources get the extra copy is drawn by `rng`. A copy
     equals its source except its rollout id (`f"{source}c{k}"`, the k-th copy) and
     `copy_of` (= the source's rollout id).
  3. Otherwise the group is dropped (ledger reason "refill_failed"); `invalid` names the
     removed rollouts and their statuses for the ledger either way.

`advantages` is GRPO's group-relative advantage (reward minus the group mean, optionally
over the sample std + eps), the numpy twin of `glm5_jax.policy_losses.group_advantages`, one
value per rollout; every segment of a rollout shares it (`flatten`). Repeating valid samples
changes the group baseline: the mean is over the filled group, so copies weigh as samples.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from glm5_jax.rl.algorithm.trajectory import Trajectory

TRAINED = ("ok", "truncated")     # statuses the trainer learns from; the rest are filtered


def segments(rollout) -> list[Trajectory]:
  """The segments of a rollout (a bare Trajectory is a one-segment rollout)."""
  segs = [rollout] if isinstance(rollout, Trajectory) else list(rollout)
  if not segs:
    raise ValueError("groups: a rollout with no segments")
  rid = segs[0].rollout_id
  if any(s.rollout_id != rid for s in segs):
    raise ValueError(f"groups: one rollout holds segments of rollout ids "
                     f"{sorted({s.rollout_id for s in segs})}")
  return segs


def rollout_id(rollout) -> str:
  return segments(rollout)[0].rollout_id


def status(rollout) -> str:
  """The first non-"ok" status among the rollout's segments, else "ok"."""
  return next((s.status for s in segments(rollout) if s.status != "ok"), "ok")


def reward(rollout) -> float:
  segs = segments(rollout)
  if any(s.reward != segs[0].reward for s in segs):
    raise ValueError(f"groups: rollout {segs[0].rollout_id} has segments with different "
                     f"rewards {[s.reward for s in segs]}; every segment carries the "
                     "rollout's reward")
  return float(segs[0].reward)


def invalid(group: Sequence) -> list[tuple[str, str]]:
  """(rollout id, status) of every rollout refill removes (ledger: dropped, reason=status)."""
  return [(rollout_id(r), status(r)) for r in group if status(r) not in TRAINED]


def _check_ids(group) -> None:
  ids = [rollout_id(r) for r in group]
  if "" in ids or len(set(ids)) != len(ids):
    raise ValueError(f"groups: rollout ids must be unique and non-empty, got {ids}")


def _copy(rollout, new_id: str):
  src = rollout_id(rollout)
  out = [_copy_segment(s, new_id, src) for s in segments(rollout)]
  return out[0] if isinstance(rollout, Trajectory) else out


def _copy_segment(seg: Trajectory, new_id: str, source_id: str) -> Trajectory:
  c = copy.deepcopy(seg)
  c.rollout_id, c.copy_of = new_id, source_id
  return c


def refill(group: Sequence, rng: np.random.Generator) -> list | None:
  """The group filled back to G with copies of valid rollouts, or None (module docstring).

  group: G rollouts (each a list of segments, or a Trajectory); rng: draws which sources get
  the extra copy. Returns valid rollouts in their order, then the copies; each copy has the
  form of its source (list or Trajectory).
  """
  _check_ids(group)
  g = len(group)
  valid = [r for r in group if status(r) in TRAINED]
  if 2 * len(valid) <= g:
    return None
  q, rem = divmod(g - len(valid), len(valid))
  extra = set(rng.choice(len(valid), size=rem, replace=False).tolist()) if rem else set()
  taken = {rollout_id(r) for r in group}
  copies = []
  for i, src in enumerate(valid):
    k = 0
    for _ in range(q + (i in extra)):
      k += 1
      while f"{rollout_id(src)}c{k}" in taken:
        k += 1
      new_id = f"{rollout_id(src)}c{k}"
      taken.add(new_id)
      copies.append(_copy(src, new_id))
  return valid + copies


def advantages(group: Sequence, normalize_std: bool = False, eps: float = 1e-6
               ) -> np.ndarray:
  """float32 [G]: reward - group mean (/ (sample std + eps) if normalize_std; a group of one
  gets 0), as `glm5_jax.policy_losses.group_advantages` on one group."""
  r = np.asarray([reward(x) for x in group], np.float64)
  if not r.size:
    raise ValueError("groups.advantages: an empty group")
  centred = r - r.mean()
  if normalize_std:
    std = np.sqrt(np.sum(centred ** 2) / max(r.size - 1, 1))
    centred = centred / (std + eps)
  return centred.astype(np.float32)


def flatten(group: Sequence, adv) -> tuple[list[Trajectory], np.ndarray]:
  """(every segment of every rollout, float32 advantage of each): `make_batch`'s inputs."""
  adv = np.asarray(adv, np.float32)
  if adv.shape != (len(group),):
    raise ValueError(f"groups.flatten: advantages of shape {adv.shape}, expected "
                     f"({len(group)},)")
  trajs, out = [], []
  for r, a in zip(group, adv):
    segs = segments(r)
    trajs += segs
    out += [a] * len(segs)
  return trajs, np.asarray(out, np.float32)
