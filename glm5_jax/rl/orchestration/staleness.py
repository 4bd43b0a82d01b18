"""Staleness: the version-span filter at consumption and admission control (GLM-5 paper §3).

Every loss token carries the weight version that sampled it (`Trajectory.versions`). With
the trainer at version `v_now`:

  span(group)        = v_now - (oldest loss-token version in the group)
  stale(group)       = span > tau: dropped at consumption (ledger reason "stale"), its prompt
                       re-queued untouched under a new group id.
  from_future(group) = some loss token's version > v_now: a trajectory sampled by weights the
                       trainer does not have (e.g. results that outlived a trainer restart
                       from an older checkpoint); rejected (reason "future_version").

Admission control keeps in-flight work from outrunning tau: AReaL's rule (Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning",
arXiv 2505.24298; its `StalenessManager`), counted in groups with B = groups consumed per
weight version:

  capacity = max(0, min(max_running - running, (tau + v_now + 1) * B - (consumed + running)))

so `consumed + running <= (tau + v_now + 1) * B` holds after every admission: a group admitted
now is consumed at the latest by version v_now + tau. `consumed` counts groups the trainer
took (dropped groups are not consumed; their prompts come back through new admissions). After
a restart `consumed` must be restored with the version (AReaL issue #1388: a counter that
restarts at 0 while the version is restored lets capacity balloon to (tau + v + 1) * B);
`consumed_after_restore` gives the value to restore when only the version was saved.
"""

from __future__ import annotations

from typing import Iterable

from glm5_jax.rl.algorithm.trajectory import Trajectory


def _trajectories(group) -> list[Trajectory]:
  """Every segment of a group given as Trajectories, rollouts (lists) or both, nested."""
  if isinstance(group, Trajectory):
    return [group]
  out = []
  for x in group:
    out += _trajectories(x)
  return out


def _versions(group, which: str) -> list[int]:
  return [v for v in (getattr(t, which) for t in _trajectories(group)) if v is not None]


def span(trajs: Iterable, current_version: int) -> int:
  """current_version - the oldest loss-token version in `trajs` (0 when none has a loss
  token)."""
  oldest = _versions(trajs, "oldest_version")
  return int(current_version - min(oldest)) if oldest else 0


def stale(group: Iterable, current_version: int, tau: int) -> bool:
  """span > tau: the group is too old to train on."""
  if tau < 0:
    raise ValueError(f"staleness: tau={tau}, expected >= 0")
  return span(group, current_version) > tau


def from_future(group: Iterable, current_version: int) -> bool:
  """Some loss token was sampled by a version newer than the trainer's."""
  return any(v > current_version for v in _versions(group, "newest_version"))


def admission_capacity(*, version: int, tau: int, groups_per_version: int, consumed: int,
                       running: int, max_running: int) -> int:
  """How many more groups may be admitted now (AReaL's rule, module docstring), >= 0."""
  for name, x in (("version", version), ("tau", tau), ("consumed", consumed),
                  ("running", running), ("max_running", max_running)):
    if x < 0:
      raise ValueError(f"admission_capacity: {name}={x}, expected >= 0")
  if groups_per_version < 1:
    raise ValueError(f"admission_capacity: groups_per_version={groups_per_version}, "
                     "expected >= 1")
  by_staleness = (tau + version + 1) * groups_per_version - (consumed + running)
  return max(0, min(max_running - running, by_staleness))


def consumed_after_restore(version: int, groups_per_version: int) -> int:
  """The `consumed` counter for a run restored at `version` when only the version was saved
  (AReaL's fix for #1388: version * B); prefer the saved counter when there is one."""
  return version * groups_per_version
