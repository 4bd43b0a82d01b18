"""Groups from admission to the trainer: routing, worker messages, fencing, staleness.

The asynchronous trainer's worker side (GLM-5 paper §3; glm5_jax/rl/orchestration/
async_loop.py): `admit` starts as many groups as admission control allows
(`staleness.admission_capacity`), each routed to a worker (`routing.Router`); `pump` handles
the workers' messages (heartbeats, finished groups: failure filtering and refill,
`groups.refill`; errors) and restarts silent or failed workers at a new epoch, their
in-flight groups re-queued (`heartbeat.Monitor` fences the old incarnation); `take` hands
the trainer `groups_per_update` ready groups that pass the staleness rules. Every step is
ledgered (`ledger.Ledger`). The counters and queues a checkpoint holds are the trainer's
`control.Control`, shared.
"""

from __future__ import annotations

import collections
import dataclasses
import queue

from absl import logging

from glm5_jax.rl.algorithm import groups as groups_lib
from glm5_jax.rl.algorithm import trajectory as traj_lib
from glm5_jax.rl.algorithm.seeds import seed_of
from glm5_jax.rl.orchestration import heartbeat
from glm5_jax.rl.orchestration import routing
from glm5_jax.rl.orchestration import staleness


@dataclasses.dataclass
class Group:
  """A finished group on the trainer's side: its rollouts (each a list of segments)."""
  group_id: str
  prompt_index: int
  rollouts: list
  worker: int


class GroupStream:
  """The groups of one run between admission and the trainer (module docstring).

  r: the config's `rl` section; ctl: the trainer's `control.Control` (counters, re-queued
  prompts, refill RNG); prompts: `control.Prompts`. `backend` and `ledger` are set by the
  trainer once they exist; `epochs` are the workers' current epochs.
  """

  def __init__(self, r, seed: int, ctl, prompts, *, clock):
    self.r, self.seed, self.ctl, self.prompts, self.clock = r, seed, ctl, prompts, clock
    self.in_flight: dict = {}                 # group id -> (prompt index, worker)
    self.ready: list[Group] = []
    self.monitor = heartbeat.Monitor(r.heartbeat_timeout_s, clock=clock)
    self.router = routing.Router(r.workers, load_bound=r.route_load_bound, seed=seed)
    self.worker_stats: dict = {}
    self.counts = collections.Counter()
    self.ledger = self.backend = None
    self.epochs = [0] * r.workers
    self.kill_at = None                       # faults.kill_worker_after_s, on the clock

  def admit(self):
    """Admits as many groups as admission control allows, each routed to a worker."""
    cap = staleness.admission_capacity(
        version=self.ctl.version, tau=self.r.tau,
        groups_per_version=self.r.groups_per_update * self.r.updates_per_publish,
        consumed=self.ctl.consumed, running=len(self.in_flight) + len(self.ready),
        max_running=self.r.max_groups_in_flight)
    for _ in range(cap):
      if self.ctl.requeue:
        index = self.ctl.requeue.popleft()
      else:
        index, self.ctl.cursor = self.ctl.cursor, self.ctl.cursor + 1
      gid = f"g{self.ctl.admitted:06d}"
      self.ctl.admitted += 1
      wid = self.router.route(gid)
      self.in_flight[gid] = (index, wid)
      self.ledger.write(gid, "group", "admitted", prompt_index=index, worker=wid,
                        version=self.ctl.version)
      self.backend.inbox(wid).put({"group_id": gid, "prompt_index": index,
                             "problem": self.prompts[index], "group_size": self.r.group_size,
                             "seed": seed_of(self.seed, 13, self.ctl.admitted)})

  def drop(self, gid, index, reason, requeue: bool, rollouts=()):
    """Ledgers group `gid` and its rollouts' segments dropped for `reason`; `requeue`: its
    prompt is admitted again, untouched."""
    for rollout in rollouts:
      for seg in rollout:
        self.ledger.write(seg.id, "trajectory", "dropped", reason=reason, group=gid)
    self.ledger.write(gid, "group", "dropped", reason=reason, prompt_index=index)
    self.counts[f"dropped_{reason}"] += 1
    if requeue:
      self.ctl.requeue.append(index)

  def on_group(self, wid, epoch, res):
    """A worker's finished group: refused from a fenced incarnation; else ledgered,
    failure-filtered and refilled (`groups.refill`), and ready unless dropped."""
    gid = res["group_id"]
    if not self.monitor.accepts(wid, epoch) or gid not in self.in_flight:
      self.counts["fenced_results"] += 1         # a fenced worker's late result: refused
      return
    index, _ = self.in_flight.pop(gid)
    self.router.release(gid)
    rollouts = res["rollouts"]
    for rollout in rollouts:
      for seg in rollout:               # storage: its tokens and its routing records' bytes
        self.ledger.write(seg.id, "trajectory", "finished", status=seg.status, group=gid,
                          reward=seg.reward, tokens=seg.length,
                          routing_bytes=traj_lib.routing_bytes(seg))
    self.ledger.write(gid, "group", "finished", prompt_index=index)
    statuses = collections.Counter(ro[0].status for ro in rollouts)
    for s, n in statuses.items():
      self.counts[f"status_{s}"] += n
    filled = groups_lib.refill(rollouts, self.ctl.rng)
    kept_ids = {seg.id for ro in (filled or []) for seg in ro}
    for rollout in rollouts:                    # invalid rollouts leave here
      for seg in rollout:
        if seg.id not in kept_ids:
          self.ledger.write(seg.id, "trajectory", "dropped",
                            reason=seg.status if seg.status != "ok" else "refill_failed",
                            group=gid)
    if filled is None:
      self.ledger.write(gid, "group", "dropped", reason="refill_failed", prompt_index=index)
      self.counts["dropped_refill_failed"] += 1
      return
    for ro in filled:
      for seg in ro:
        if seg.copy_of is not None:
          self.counts["refill_copies"] += 1
          self.ledger.write(seg.id, "trajectory", "finished", status=seg.status, group=gid,
                            copy_of=seg.copy_of)
    self.ready.append(Group(gid, index, filled, wid))

  def on_message(self, msg):
    """One message of the outbox: a heartbeat, a finished group or a worker's error."""
    kind, wid, epoch, payload = msg
    if kind == "beat":
      if self.monitor.accepts(wid, epoch):
        self.monitor.beat(wid, epoch)
        self.worker_stats[(wid, epoch)] = payload     # every incarnation's counters
    elif kind == "group":
      self.on_group(wid, epoch, payload)
    elif kind == "error":
      if self.monitor.accepts(wid, epoch):
        logging.error("[rl_async] worker %d (epoch %d) failed:\n%s", wid, epoch, payload)
        self.restart(wid, "worker_error")
    else:
      raise ValueError(f"unknown worker message {kind!r}")

  def restart(self, wid: int, reason: str):
    """Fences worker wid, re-queues its in-flight groups, starts it again (new epoch)."""
    self.epochs[wid] = self.monitor.fence(wid)
    lost = [g for g, (_, w) in self.in_flight.items() if w == wid]
    for gid in lost:
      index, _ = self.in_flight.pop(gid)
      self.router.release(gid)
      self.drop(gid, index, "worker_dead", requeue=True)
    self.counts["worker_restarts"] += 1
    logging.warning("[rl_async] worker %d %s: fenced, %d groups re-queued, restarted at "
                    "epoch %d", wid, reason, len(lost), self.epochs[wid])
    self.backend.restart(wid, self.epochs[wid])   # it pulls the latest version first

  def pump(self, timeout: float):
    """Admits work, handles worker messages for up to `timeout` s, restarts dead workers."""
    self.admit()
    if self.kill_at is not None and self.clock() >= self.kill_at:
      logging.warning("[rl_async] fault injection: killing worker 0")
      self.backend.kill(0)
      self.kill_at = None
    deadline = self.clock() + timeout
    while True:
      try:
        msg = self.backend.outbox.get(timeout=max(0.0, min(0.02, deadline - self.clock())))
      except queue.Empty:
        msg = None
      if msg is not None:
        self.on_message(msg)
        continue                  # drain first: beats queued while the trainer was busy
      for wid in self.monitor.dead():
        self.restart(wid, "silent")
      if self.clock() >= deadline:
        return

  def take(self) -> list[Group] | None:
    """groups_per_update ready groups that pass the staleness rules, oldest first."""
    keep = []
    for g in self.ready:
      segs = [s for ro in g.rollouts for s in ro]
      if staleness.from_future(segs, self.ctl.version):
        self.drop(g.group_id, g.prompt_index, "future_version", requeue=True,
                         rollouts=g.rollouts)
      elif staleness.stale(segs, self.ctl.version, self.r.tau):
        self.drop(g.group_id, g.prompt_index, "stale", requeue=True,
                         rollouts=g.rollouts)
      else:
        keep.append(g)
    self.ready = keep
    if len(keep) < self.r.groups_per_update:
      return None
    taken, self.ready = keep[:self.r.groups_per_update], keep[self.r.groups_per_update:]
    return taken
