"""Fully asynchronous agentic RL (GLM-5 paper §3): rollout workers stream, the trainer updates.

`run(config, workdir)`. Rollout workers (`rollout_worker.RolloutWorker`, on their own devices)
run multi-turn tool-use episodes continuously; the trainer (this process, its own device)

  1. admits prompts as groups of G episodes while admission control allows (AReaL's rule,
     `staleness.admission_capacity`), routing each group to a worker by consistent hashing
     with bounded loads (`routing.Router`: every turn of its episodes lands on the worker
     that caches their shared prompt and their conversations);
  2. collects finished groups: environment failures keep their status; a group with more
     than half valid rollouts is refilled with copies of valid ones, otherwise dropped
     (`groups.refill`);
  3. once `groups_per_update` groups are ready, drops those whose tokens span more than tau
     versions (`staleness.stale`; the prompt is re-queued untouched) or claim a version
     newer than the trainer's (after a restart), and takes one optimizer step on
     `losses.double_sided_is_loss` against the rollout log-probs, the tokens exactly as the
     engine produced them (TITO; no recomputed old policy, the indexer frozen);
  4. every `updates_per_publish` (K) updates publishes the weights as a new version
     (`weights.publish`) and resets the optimizer state (GLM-5 §3).
Workers heartbeat; a silent one is fenced (its late results refused), restarted at a new
epoch, brought to the current version, and its in-flight groups re-queued. Every prompt and
trajectory id goes through the ledger (`WORKDIR/rollouts.jsonl`, `ledger.audit`).

Train/rollout consistency is measured per version: the trainer keeps the last tau + 1
published versions and recomputes each token's log-prob (and the DSA top-k) under the
version that sampled it: `logp_abs_diff_max` and `topk_mismatches` in every metrics row.

Backends (`config.rl.backend`): "local" runs the workers as threads of this process on the
devices after the trainer's; "ray" runs them as Ray actors (their own processes and JAX
runtimes) reading versioned, checksummed weight snapshots from WORKDIR/weights.

Checkpoints hold params, optimizer state, and the control state (update and version
counters, consumed groups, the prompt cursor, the prompts in flight, which a resumed run
admits first). The run is asynchronous, so a resumed run is not bitwise the uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import queue
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from glm5_jax import numerics
from glm5_jax import timing
from glm5_jax.data import chat
from glm5_jax.rl import agent as agent_lib
from glm5_jax.rl import context as context_lib
from glm5_jax.rl import grpo
from glm5_jax.rl import groups as groups_lib
from glm5_jax.rl import heartbeat
from glm5_jax.rl import ledger as ledger_lib
from glm5_jax.rl import losses as rl_losses
from glm5_jax.rl import policy
from glm5_jax.rl import rollout_worker as worker_lib
from glm5_jax.rl import routing
from glm5_jax.rl import staleness
from glm5_jax.rl import trajectory as traj_lib
from glm5_jax.rl import weights as weights_lib
from glm5_jax.train import checkpoint as ckpt_lib
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import preemption
from glm5_jax.train import step as step_lib

BACKENDS = ("local", "ray")


def validate(c) -> None:
  r = c.rl
  if c.stage != "rl":
    raise ValueError(f"config.stage={c.stage!r}: RL runs stage 'rl' (the indexer frozen)")
  if r.backend not in BACKENDS:
    raise ValueError(f"config.rl.backend={r.backend!r}: expected one of {BACKENDS}")
  for f in ("group_size", "groups_per_update", "updates_per_publish", "workers",
            "engine_batch", "episodes_per_worker", "max_new_tokens", "max_len", "max_turns",
            "prefill_chunk", "steps_per_sync", "tool_threads", "logprob_chunk", "eval_every",
            "checkpoint_every", "eval_problems", "max_groups_in_flight"):
    if r[f] < 1:
      raise ValueError(f"config.rl.{f}={r[f]}: expected >= 1")
  longest = traj_lib.bucket_length(r.max_len)
  if any(not isinstance(t, int) or t < 1 or t > longest for t in r.warmup_lengths):
    raise ValueError(f"config.rl.warmup_lengths={tuple(r.warmup_lengths)}: expected ints in "
                     f"[1, {longest}] (padded lengths up to config.rl.max_len's bucket)")
  if r.tau < 0:
    raise ValueError(f"config.rl.tau={r.tau}: expected >= 0 (0 = every token of a consumed "
                     "group from the current version)")
  if r.group_size < 2:
    raise ValueError(f"config.rl.group_size={r.group_size}: expected >= 2 (group-relative "
                     "advantages)")
  if r.episodes_per_worker < r.group_size:
    raise ValueError(f"config.rl.episodes_per_worker={r.episodes_per_worker}: expected >= "
                     f"config.rl.group_size={r.group_size} (a worker runs whole groups)")
  if r.temperature != 1.0:
    raise ValueError(f"config.rl.temperature={r.temperature}: expected 1.0; the IS ratios "
                     "compare raw-policy log-probs, the sampling distribution's only at 1")
  for name in ("eps_low", "eps_high"):
    try:
      rl_losses.check_hparams(**{name: r[name]})
    except ValueError as e:
      raise ValueError(f"config.rl.{name}: {e}") from None
  for name in ("env_crash_rate", "slow_env_tail"):
    if not 0.0 <= r.faults[name] <= 1.0:
      raise ValueError(f"config.rl.faults.{name}={r.faults[name]}: expected a probability")
  try:
    context_lib.ContextPolicy(**r.context)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.rl.context={dict(r.context)}: {e}") from None
  worker_lib.task_of(r.to_dict())
  ckpt_lib.check_run_fields(c, ("log_every", "total_steps"))
  if not c.init_from:
    raise ValueError("config.init_from: agentic RL starts from a trained model (an SFT "
                     "workdir of the tool task, a pretraining workdir or an HF directory)")


def split_devices(n_workers: int):
  """(trainer device, each worker's device index): the trainer on device 0, workers round
  robin over the others (all on device 0 when there is only one)."""
  n = jax.device_count()
  if n == 1:
    return jax.devices()[0], [0] * n_workers
  return jax.devices()[0], [1 + i % (n - 1) for i in range(n_workers)]


class Prompts:
  """The task's training prompts as an endless indexed stream (chunks of distinct draws)."""

  def __init__(self, task, seed: int, chunk: int = 512):
    self.task, self.seed, self.chunk = task, seed, chunk
    self._cache: dict = {}

  def __getitem__(self, index: int):
    c = index // self.chunk
    if c not in self._cache:
      self._cache = {c: self.task.problems("train", self.chunk,
                                           grpo.seed_of(self.seed, 7, c))}
    return self._cache[c][index % self.chunk]


def make_train_fns(cfg, tx, r):
  """Jitted (logprobs, update) of the trainer:
    logprobs(params, batch) -> (logp [b, t], entropy [b, t], top-k [L] of [b, t, K])
    update(params, opt_state, batch) -> (params, opt_state, metrics): one optimizer step on
      double_sided_is_loss against batch["rollout_logp"]."""
  fwd = functools.partial(policy.policy_forward, cfg=cfg, chunk_size=r.logprob_chunk)

  @jax.jit
  def logprobs(params, b):
    return fwd(params, b["tokens"], b["positions"], b["segment_ids"], return_topk=True)

  @jax.jit
  def update(params, opt_state, b):
    def loss_fn(p):
      logp, ent, _ = fwd(p, b["tokens"], b["positions"], b["segment_ids"])
      loss, m = rl_losses.double_sided_is_loss(logp, b["rollout_logp"], b["advantages"],
                                               b["loss_mask"], eps_low=r.eps_low,
                                               eps_high=r.eps_high)
      return loss, {**m, "entropy": rl_losses.token_mean(ent, b["loss_mask"])}
    (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {**m, "loss": loss, "grad_norm": optax.global_norm(grads),
                               "update_norm": optax.global_norm(updates)}

  return logprobs, update


@dataclasses.dataclass
class Group:
  """A finished group on the trainer's side: its rollouts (each a list of segments)."""
  group_id: str
  prompt_index: int
  rollouts: list
  worker: int


def batch_of(groups, normalize_std: bool, rows_multiple: int = 1):
  """(TrajectoryBatch, segment list) of the segments of `groups`, each carrying its rollout's
  group-relative advantage. Rows are padded to a power of two (at least `rows_multiple`) by
  copies of row 0 without loss, so few distinct shapes compile."""
  segs, advs = [], []
  for g in groups:
    for rollout, a in zip(g.rollouts, groups_lib.advantages(g.rollouts, normalize_std)):
      for seg in rollout:
        segs.append(seg)
        advs.append(a)
  n = max(rows_multiple, traj_lib.bucket_length(len(segs), minimum=1))
  pad = n - len(segs)
  batch = traj_lib.make_batch(segs + [segs[0]] * pad, advs + [0.0] * pad)
  if pad:
    batch.loss_mask[len(segs):] = 0.0
    batch.versions[len(segs):] = -1
  return batch, segs


def consistency(logprobs, snapshots: dict, batch, segs) -> dict:
  """Train/rollout agreement, each token under the version that sampled it: log-prob |diff|
  (max, mean) and top-k mismatches (positions whose engine top-k set differs in some layer)."""
  dev = {k: jnp.asarray(getattr(batch, k)) for k in ("tokens", "positions", "segment_ids")}
  mask = batch.loss_mask > 0
  diffs, bad, total, unmeasured = [], 0, 0, 0
  for v in sorted(set(batch.versions[mask].tolist())):
    sel = mask & (batch.versions == v)
    if v not in snapshots:
      unmeasured += int(sel.sum())
      continue
    logp, _, topk = logprobs(snapshots[v], dev)
    diffs.append(np.abs(batch.rollout_logp[sel] - np.asarray(logp, np.float64)[sel]))
    # The top-k at position p chose the keys for the token at p + 1: compare where that
    # token was sampled by version v.
    mine = []
    for i, tr in enumerate(segs):
      keep = {p: x for p, x in (tr.topk or {}).items()
              if p + 1 < len(tr.versions) and tr.versions[p + 1] == v}
      mine.append(dataclasses.replace(tr, topk=keep))
    b, t = policy.topk_mismatches(mine, topk)
    bad, total = bad + b, total + t
  d = np.concatenate(diffs) if diffs else np.zeros(0)
  return {"logp_abs_diff_max": float(d.max(initial=0.0)),
          "logp_abs_diff_mean": float(d.mean()) if d.size else 0.0,
          "topk_mismatches": float(bad), "topk_positions": float(total),
          "logp_unmeasured_tokens": float(unmeasured)}


class Control:
  """The trainer's counters and queues that a checkpoint holds (besides params, optimizer)."""

  def __init__(self, seed: int):
    self.update = self.version = self.consumed = self.admitted = self.cursor = 0
    self.requeue: collections.deque = collections.deque()   # pristine prompt indices
    self.rng = np.random.default_rng(grpo.seed_of(seed, 11))

  def to_json(self, in_flight) -> dict:
    return {"update": self.update, "version": self.version, "consumed": self.consumed,
            "admitted": self.admitted, "cursor": self.cursor,
            "requeue": list(self.requeue) + sorted(in_flight),
            "rng": self.rng.bit_generator.state}

  def load(self, d: dict):
    for f in ("update", "version", "consumed", "admitted", "cursor"):
      setattr(self, f, int(d[f]))
    self.requeue = collections.deque(int(i) for i in d["requeue"])
    self.rng.bit_generator.state = d["rng"]


def _control_path(workdir, update):
  return os.path.join(workdir, "rl_control", f"{update}.json")


def _write_json(path, obj):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f)
  os.replace(path + ".tmp", path)


def make_backend(c, workdir):
  """(backend, weights store) for config.rl.backend."""
  if c.rl.backend == "local":
    from glm5_jax.rl import local_backend  # pylint: disable=g-import-not-at-top
    store = weights_lib.InProcessWeights(keep=1)
    return local_backend.LocalBackend(worker_lib.RolloutWorker, store), store
  from glm5_jax.rl import ray_backend  # pylint: disable=g-import-not-at-top
  store = weights_lib.FileWeights(os.path.join(workdir, "weights"), keep=c.rl.tau + 2)
  return ray_backend.RayBackend(worker_lib.RolloutWorker, store,
                                num_cpus=c.rl.ray_cpus_per_worker), store


class Trainer:
  """The asynchronous loop's trainer side (module docstring). One per `run`."""

  def __init__(self, c, workdir: str, *, clock=time.monotonic):
    self.c, self.r, self.workdir, self.clock = c, c.rl, workdir, clock
    r = c.rl
    cfg, params = grpo.load_policy(c.init_from, "config.init_from")
    self.cfg = cfg.replace(attention_type="sparse")
    ckpt_lib.check_model_config(workdir, self.cfg)
    self.rd = r.to_dict()
    self.task = worker_lib.task_of(self.rd)
    self.tok = chat.get_chat_tokenizer(c.data.tokenizer)
    if self.tok.vocab_size > self.cfg.vocab_size:
      raise ValueError(f"config.data.tokenizer={c.data.tokenizer!r} has "
                       f"{self.tok.vocab_size} ids > the model's vocab_size="
                       f"{self.cfg.vocab_size}")
    self.device, self.worker_devices = split_devices(r.workers)
    self.tx = step_lib.make_optimizer(c)
    self.params = jax.device_put(params, self.device)
    self._opt_init = jax.jit(self.tx.init)
    self.opt_state = self._opt_init(self.params)
    self.logprobs, self.update_fn = make_train_fns(self.cfg, self.tx, r)
    self.prompts = Prompts(self.task, c.seed)
    self.ctl = Control(c.seed)
    self.snapshots: dict = {}                 # version -> params (the last tau + 1)
    self.in_flight: dict = {}                 # group id -> (prompt index, worker)
    self.ready: list[Group] = []
    self.monitor = heartbeat.Monitor(r.heartbeat_timeout_s, clock=clock)
    self.router = routing.Router(r.workers, load_bound=r.route_load_bound, seed=c.seed)
    self.worker_stats: dict = {}
    self.counts = collections.Counter()
    self.spans = collections.Counter()
    self.ledger = None
    self.backend = self.store = None
    self.epochs = [0] * r.workers
    self.kill_at = None                       # faults.kill_worker_after_s, on the clock

  # ------------------------------------------------------------------ workers
  def _spec(self, wid: int) -> dict:
    return {"worker_id": wid, "epoch": self.epochs[wid], "device": self.worker_devices[wid]
            if self.r.backend == "local" else None,
            "model_config": ckpt_lib.model_fields(self.cfg), "rl": self.rd,
            "tokenizer": self.c.data.tokenizer, "seed": self.c.seed}

  def _publish(self):
    v = self.ctl.version
    self.store.publish(self.params, v)
    self.snapshots[v] = self.params
    for old in [k for k in self.snapshots if k < v - self.r.tau]:
      del self.snapshots[old]

  def _admit(self):
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
                             "seed": grpo.seed_of(self.c.seed, 13, self.ctl.admitted)})

  def _drop_group(self, gid, index, reason, requeue: bool, rollouts=()):
    for rollout in rollouts:
      for seg in rollout:
        self.ledger.write(seg.id, "trajectory", "dropped", reason=reason, group=gid)
    self.ledger.write(gid, "group", "dropped", reason=reason, prompt_index=index)
    self.counts[f"dropped_{reason}"] += 1
    if requeue:
      self.ctl.requeue.append(index)

  def _on_group(self, wid, epoch, res):
    gid = res["group_id"]
    if not self.monitor.accepts(wid, epoch) or gid not in self.in_flight:
      self.counts["fenced_results"] += 1         # a fenced worker's late result: refused
      return
    index, _ = self.in_flight.pop(gid)
    self.router.release(gid)
    rollouts = res["rollouts"]
    for rollout in rollouts:
      for seg in rollout:
        self.ledger.write(seg.id, "trajectory", "finished", status=seg.status, group=gid,
                          reward=seg.reward)
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

  def _on_message(self, msg):
    kind, wid, epoch, payload = msg
    if kind == "beat":
      if self.monitor.accepts(wid, epoch):
        self.monitor.beat(wid, epoch)
        self.worker_stats[(wid, epoch)] = payload     # every incarnation's counters
    elif kind == "group":
      self._on_group(wid, epoch, payload)
    elif kind == "error":
      if self.monitor.accepts(wid, epoch):
        logging.error("[rl_async] worker %d (epoch %d) failed:\n%s", wid, epoch, payload)
        self._restart(wid, "worker_error")
    else:
      raise ValueError(f"unknown worker message {kind!r}")

  def _restart(self, wid: int, reason: str):
    """Fences worker wid, re-queues its in-flight groups, starts it again (new epoch)."""
    self.epochs[wid] = self.monitor.fence(wid)
    lost = [g for g, (_, w) in self.in_flight.items() if w == wid]
    for gid in lost:
      index, _ = self.in_flight.pop(gid)
      self.router.release(gid)
      self._drop_group(gid, index, "worker_dead", requeue=True)
    self.counts["worker_restarts"] += 1
    logging.warning("[rl_async] worker %d %s: fenced, %d groups re-queued, restarted at "
                    "epoch %d", wid, reason, len(lost), self.epochs[wid])
    self.backend.restart(wid, self.epochs[wid])   # it pulls the latest version first

  def _pump(self, timeout: float):
    """Admits work, handles worker messages for up to `timeout` s, restarts dead workers."""
    self._admit()
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
        self._on_message(msg)
        continue                  # drain first: beats queued while the trainer was busy
      for wid in self.monitor.dead():
        self._restart(wid, "silent")
      if self.clock() >= deadline:
        return

  # ------------------------------------------------------------------ training
  def _take(self) -> list[Group] | None:
    """groups_per_update ready groups that pass the staleness rules, oldest first."""
    keep = []
    for g in self.ready:
      segs = [s for ro in g.rollouts for s in ro]
      if staleness.from_future(segs, self.ctl.version):
        self._drop_group(g.group_id, g.prompt_index, "future_version", requeue=True,
                         rollouts=g.rollouts)
      elif staleness.stale(segs, self.ctl.version, self.r.tau):
        self._drop_group(g.group_id, g.prompt_index, "stale", requeue=True,
                         rollouts=g.rollouts)
      else:
        keep.append(g)
    self.ready = keep
    if len(keep) < self.r.groups_per_update:
      return None
    taken, self.ready = keep[:self.r.groups_per_update], keep[self.r.groups_per_update:]
    return taken

  def warmup(self, lengths) -> None:
    """Compiles the trainer's steps for batches of N x G rows padded to each of `lengths`
    (results discarded), so that a long run does not stall on a new length later."""
    rows = traj_lib.bucket_length(self.r.groups_per_update * self.r.group_size, minimum=1)
    for t in lengths:
      dummy = traj_lib.Trajectory([0] * t, [0.0] * t, [0.0] * t, [-1] * t)
      batch = traj_lib.make_batch([dummy] * rows, np.zeros(rows), length=t)
      dev = grpo.device_batch(batch)
      jax.block_until_ready(self.logprobs(self.params, dev))
      jax.block_until_ready(self.update_fn(self.params, self.opt_state, dev))

  def _train(self, taken: list[Group]) -> dict:
    t0 = time.perf_counter()
    batch, segs = batch_of(taken, self.r.normalize_std)
    m = consistency(self.logprobs, self.snapshots, batch, segs)
    dev = grpo.device_batch(batch)
    self.params, self.opt_state, mu = self.update_fn(self.params, self.opt_state, dev)
    m.update({k: float(v) for k, v in jax.device_get(mu).items()})
    rewards = np.asarray([ro[0].reward for g in taken for ro in g.rollouts])
    spans = [staleness.span([s for ro in g.rollouts for s in ro], self.ctl.version)
             for g in taken]
    for s in spans:
      self.spans[s] += 1
    for g in taken:
      for ro in g.rollouts:
        for seg in ro:
          self.ledger.write(seg.id, "trajectory", "consumed", group=g.group_id,
                            update=self.ctl.update)
      self.ledger.write(g.group_id, "group", "consumed", update=self.ctl.update)
    self.ctl.consumed += len(taken)
    self.ctl.update += 1
    if self.ctl.update % self.r.updates_per_publish == 0:
      self.ctl.version += 1
      self._publish()
      self.opt_state = self._opt_init(self.params)     # reset at every push (GLM-5 §3)
    m.update(reward_mean=float(rewards.mean()), success_rate=float(np.mean(rewards >= 1.0)),
             staleness_mean=float(np.mean(spans)), staleness_max=float(max(spans)),
             segments=float(len(segs)), batch_length=float(batch.tokens.shape[1]),
             version=float(self.ctl.version), update_s=time.perf_counter() - t0,
             in_flight=float(len(self.in_flight)), ready=float(len(self.ready)))
    return m

  # ------------------------------------------------------------------ evaluation
  def evaluate(self, problems) -> dict:
    """Greedy multi-turn episodes on held-out problems under the current params."""
    t0 = time.perf_counter()
    r = dict(self.rd, faults={"env_crash_rate": 0.0, "slow_env_tail": 0.0},
             env=dict(self.rd["env"], latency_median_s=0.0))
    if getattr(self, "_eval_engine", None) is None:
      self._eval_engine = worker_lib.build_engine(self.cfg, self.params, r, self.ctl.version,
                                                  self.device)
    else:
      self._eval_engine.update_params(self.params, self.ctl.version)
    driver = agent_lib.Driver(self._eval_engine, self.tok, threads=r["tool_threads"],
                              max_new_tokens=r["max_new_tokens"], temperature=0.0)
    try:
      ended = driver.run([worker_lib.make_episode(self.task, p, self.tok, r,
                                                  rollout_id=f"eval/{i}", group_id="eval",
                                                  prompt_index=i)
                          for i, p in enumerate(problems)])
    finally:
      driver.close()
    rewards = np.asarray([ep.reward for ep in ended])
    return {"success_rate": float(np.mean(rewards >= 1.0)),
            "reward_mean": float(rewards.mean()), "problems": float(len(ended)),
            "tool_use_rate": float(np.mean([ep.tool_turns > 0 for ep in ended])),
            "eval_s": time.perf_counter() - t0}

  # ------------------------------------------------------------------ checkpoints
  def _state(self):
    return {"params": self.params, "opt_state": self.opt_state}

  def save(self, mngr):
    in_flight = [i for i, _ in self.in_flight.values()] + [g.prompt_index for g in self.ready]
    _write_json(_control_path(self.workdir, self.ctl.update), self.ctl.to_json(in_flight))
    mngr.save(self.ctl.update, args=ocp.args.Composite(state=ocp.args.StandardSave(
        self._state())), force=True)

  def restore(self, mngr) -> bool:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), self._state())
    step, state = ckpt_lib.restore_latest(mngr, abstract, None, what="stage 'rl' (async)")
    if step is None:
      return False
    path = _control_path(self.workdir, step)
    if not os.path.exists(path):
      raise ValueError(f"{self.workdir}: checkpoint {step} has no control state {path}")
    with open(path) as f:
      self.ctl.load(json.load(f))
    self.params, self.opt_state = state["params"], state["opt_state"]
    return True


def run(c, workdir: str, *, clock=time.monotonic) -> dict:
  """Runs asynchronous agentic RL until `c.total_steps` updates (resuming from `workdir`)."""
  validate(c)
  ckpt_lib.quiet_orbax()
  if jax.default_backend() == "cpu" and not numerics.is_set():
    logging.warning("XLA:CPU without batch-invariant dots: the engine's and the trainer's "
                    "log-probs will differ in the last bits (glm5_jax/numerics.py)")
  tr = Trainer(c, workdir, clock=clock)
  r = c.rl
  heldout = tr.task.problems("heldout", r.eval_problems, c.seed)
  mngr = ckpt_lib.state_manager(workdir, keep=c.keep_checkpoints)
  preempt = preemption.Preemption()
  writer, last, stop = None, {}, False
  try:
    timing.compile_seconds()        # count compilations from here (metrics "compile_s")
    restored = tr.restore(mngr)
    start = tr.ctl.update
    if start > c.total_steps:
      raise ValueError(f"config.total_steps={c.total_steps} is below the update {start} of "
                       f"the checkpoint in {workdir}: expected >= {start}")
    writer = metrics_lib.MetricWriter(workdir, tensorboard=c.tensorboard,
                                      resume_step=start if restored else -1)
    if start == c.total_steps:
      return {**metrics_lib.final_metrics(workdir)}
    tr.ledger = _open_ledger(tr, os.path.join(workdir, "rollouts.jsonl"), restored, clock)
    if start == 0:
      ev = tr.evaluate(heldout)
      writer.write(0, ev, prefix="heldout_")
      last.update({f"heldout_{k}": v for k, v in ev.items()})
      logging.info("[rl_async] update 0 held-out success %.4f", ev["success_rate"])
    tr.backend, tr.store = make_backend(c, workdir)
    tr._publish()
    tr.backend.start([tr._spec(wid) for wid in range(r.workers)])
    for wid in range(r.workers):
      tr.monitor.register(wid)
    tr._pump(0.0)                        # admit the first groups, then, while the
    tr.warmup(r.warmup_lengths)          # workers compile and sample them, the trainer's steps
    if r.faults.kill_worker_after_s > 0:
      tr.kill_at = clock() + r.faults.kill_worker_after_s
    wait_s = 0.0
    t_loop = time.perf_counter()
    while tr.ctl.update < c.total_steps:
      t0 = time.perf_counter()
      taken = None
      while taken is None:
        tr._pump(0.02)
        taken = tr._take()
        if taken is None and time.perf_counter() - t0 > r.max_wait_s:
          raise RuntimeError(
              f"[rl_async] no update for config.rl.max_wait_s={r.max_wait_s}s: "
              f"{len(tr.in_flight)} groups in flight, {len(tr.ready)} ready, counts "
              f"{dict(tr.counts)}, worker errors {tr.backend.errors()}")
      wait_s += time.perf_counter() - t0
      m = tr._train(taken)
      wall = time.perf_counter() - t_loop
      busy = [sum(s.get("busy_s", 0.0) for (w, _), s in tr.worker_stats.items() if w == wid)
              for wid in range(r.workers)]
      m.update({k: float(v) for k, v in tr.counts.items()})
      m.update({f"staleness_hist_{k}": float(v) for k, v in sorted(tr.spans.items())})
      prefix = routing.PrefixStats()
      for s in tr.worker_stats.values():
        prefix.record(s.get("cached_prompt_tokens", 0), s.get("prompt_tokens", 0))
      compile_s, compiles = timing.compile_seconds()      # this process (local workers too)
      m.update(trainer_idle_ratio=wait_s / max(wall, 1e-9),
               compile_s=compile_s, compiles=float(compiles),
               rollout_idle_ratio=1.0 - (float(np.mean(busy)) / max(wall, 1e-9)
                                         if busy else 0.0),
               prefix_hit_rate=prefix.hit_rate,
               wall_s=wall)
      u = tr.ctl.update
      writer.write(u, m)
      last.update(m)
      done = u == c.total_steps
      stop = preempt.should_stop(u)
      if u % c.log_every == 0 or done or stop:
        logging.info("[rl_async] update %d/%d v%d  reward %.3f  success %.3f  |dlogp| max "
                     "%.2e  topk mism %d  masked %.3f  staleness %.2f  idle trainer %.2f "
                     "(%.1fs)", u, c.total_steps, tr.ctl.version, m["reward_mean"],
                     m["success_rate"], m["logp_abs_diff_max"], m["topk_mismatches"],
                     m["is_masked_frac"], m["staleness_mean"], m["trainer_idle_ratio"], wall)
      if u % r.checkpoint_every == 0 or done or stop:
        tr.save(mngr)
      writer.flush()
      if stop:
        break
      if u % r.eval_every == 0 or done:
        ev = tr.evaluate(heldout)
        writer.write(u, ev, prefix="heldout_")
        last.update({f"heldout_{k}": v for k, v in ev.items()})
        logging.info("[rl_async] update %d held-out success %.4f", u, ev["success_rate"])
  finally:
    _shutdown(tr)
    preempt.close()
    mngr.wait_until_finished()
    mngr.close()
    if writer is not None:
      writer.close()
  if stop:
    raise preemption.Preempted(tr.ctl.update, workdir)
  return last


def _open_ledger(tr: Trainer, path: str, restored: bool, clock):
  """A new ledger, or on resume the old one with what a killed run left open ledgered as
  dropped ("shutdown") and group ids continuing after every id it holds."""
  if not restored:
    return ledger_lib.Ledger(path, clock=clock)
  ledger = ledger_lib.Ledger.open(path, clock=clock)
  for kind, ids in ledger_lib.pending(path).items():
    for i in ids:
      ledger.write(i, kind, "dropped", reason="shutdown")
  gids = [int(e["id"][1:]) for e in ledger_lib.read(path)
          if e.get("kind") == "group" and e.get("event") == "admitted"]
  tr.ctl.admitted = max([tr.ctl.admitted] + [g + 1 for g in gids])
  return ledger


def _shutdown(tr: Trainer):
  """Stops the workers; work in flight or not consumed is ledgered dropped ("shutdown"); the
  checkpoint's control state re-admits those prompts on resume."""
  if tr.backend is not None:          # a worker ends at its next loop check: after at most one
    tr.backend.shutdown(timeout_s=600)  # engine step, which may be compiling (a thread left in
                                        # XLA at interpreter exit aborts the process)
  if tr.ledger is None:
    return
  for gid, (index, _) in tr.in_flight.items():
    tr.ledger.write(gid, "group", "dropped", reason="shutdown", prompt_index=index)
  for g in tr.ready:
    tr._drop_group(g.group_id, g.prompt_index, "shutdown", requeue=False, rollouts=g.rollouts)
  tr.ledger.close()
