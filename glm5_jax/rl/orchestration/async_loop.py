"""Fully asynchronous agentic RL (GLM-5 paper §3): rollout workers stream, the trainer updates.

`run(config, workdir)` = `train.loop.run(config, workdir, AsyncTrainer(config, workdir))`:
the runner owns the mesh, the state, the update (stage row "rl_async": direct double-sided IS),
checkpoints, metrics and preemption (glm5_jax/train/loop.py); `AsyncTrainer` is its batch
source, driven through its public methods only. Rollout workers (`rollout_worker.
RolloutWorker`, on their own devices) run multi-turn tool-use episodes continuously; the
trainer

  1. admits prompts as groups of G episodes while admission control allows (AReaL's rule,
     `staleness.admission_capacity`), routing each group to a worker by consistent hashing
     with bounded loads (`routing.Router`: every turn of its episodes lands on the worker
     that caches their shared prompt and their conversations);
  2. collects finished groups: environment failures keep their status; a group with more
     than half valid rollouts is refilled with copies of valid ones, otherwise dropped
     (`groups.refill`);
  3. once `groups_per_update` groups are ready, drops those whose tokens span more than tau
     versions (`staleness.stale`; the prompt is re-queued untouched) or claim a version
     newer than the trainer's (after a restart), and hands the runner one batch for one
     optimizer step on `double_sided_is_loss` against the rollout log-probs, the tokens
     exactly as the engine produced them (TITO; no recomputed old policy, the indexer
     frozen);
  4. every `updates_per_publish` (K) updates publishes the weights as a new version and
     resets the optimizer state (GLM-5 §3).
Workers heartbeat; a silent one is fenced (its late results refused), restarted at a new
epoch, brought to the current version, and its in-flight groups re-queued. Every prompt and
trajectory id goes through the ledger (`WORKDIR/rollouts.jsonl`, `ledger.audit`).

Placement (glm5_jax/rl/orchestration/weights.py). The trainer trains on the first
`config.num_devices` devices under `config.mesh` (sharded like pretraining). Backend "local": each
rollout replica is a thread of this process on its own `rl.rollout_devices` devices after the
trainer's (round robin when there are too few), serving under `rl.rollout_mesh` in the model's
shardings; a push hands the replicas the published version on the trainer's devices
(`DeviceWeights`) and each replica reshards it into its own buffers device to device, leaf by leaf.
Backend "ray": replicas are Ray actors (their own processes and JAX runtimes) reading versioned,
checksummed snapshots from WORKDIR/weights. Backend "distributed": the same snapshots, with the
workers in processes 1.. of this run's jax.distributed cluster and the trainer alone in process 0
(rl/orchestration/distributed_backend.py). A resumed run first removes the versions a killed run
published at and after its checkpoint's version.

Train/rollout consistency is measured per version: the trainer keeps the last
`rl.gap_versions` published versions (default tau + 1, sharded like its params) and
recomputes each token's log-prob (and the DSA top-k) under the version that sampled it:
`logp_abs_diff_max` and `topk_mismatches` in every metrics row (tokens of versions no longer
kept: `logp_unmeasured_tokens`), and each MoE layer's routing against the experts the engine
recorded (`routing_mismatch_rate`). The workers serve in `rl.rollout_weight_dtype` /
`rl.rollout_kv_dtype` (float32 by default: the trainer's forward bitwise; FP8 / INT4 a
deliberate gap, measured by the same metrics); `rl.routing_replay` makes the trainer's MoE
layers use the recorded experts (R3). Held-out evaluation runs at the trainer's precision.

Checkpoints hold the TrainState and the control state (update and version counters, consumed
groups, the prompt cursor, the prompts in flight, which a resumed run admits first, the
ledger's length and the metrics' running totals) as item "control" of the same orbax step.
A resumed run rolls back what a killed run ledgered after that checkpoint
(rl/orchestration/ledger.py), so no prompt counts twice. The run is asynchronous, so a resumed run
is not bitwise the uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import time

from absl import logging
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from glm5_jax import config as config_lib
from glm5_jax import convert
from glm5_jax import memory
from glm5_jax import policy
from glm5_jax import sharding as shd
from glm5_jax import timing
from glm5_jax.data import chat
from glm5_jax.nn import layer_stack
from glm5_jax.rl.algorithm import batches
from glm5_jax.rl.algorithm import consistency as consistency_lib
from glm5_jax.rl.algorithm import groups as groups_lib
from glm5_jax.rl.algorithm import trajectory as traj_lib
from glm5_jax.rl.algorithm.seeds import seed_of
from glm5_jax.rl.envs import agent as agent_lib
from glm5_jax.rl.envs import context as context_lib
from glm5_jax.rl.envs import tasks as tasks_lib
from glm5_jax.rl.orchestration import heartbeat
from glm5_jax.rl.orchestration import ledger as ledger_lib
from glm5_jax.rl.orchestration import rollout_worker as worker_lib
from glm5_jax.rl.orchestration import routing
from glm5_jax.rl.orchestration import snapshots as snapshots_lib
from glm5_jax.rl.orchestration import staleness
from glm5_jax.rl.orchestration import weights as weights_lib
from glm5_jax.train import loop

BACKENDS = ("local", "ray", "distributed")


def validate(c) -> None:
  """The config's field table (train/checks.py, stage 'rl_async') and the objects it names
  (the task, the context policy); errors name the field."""
  if c.stage != "rl_async":
    raise ValueError(f"config.stage={c.stage!r}: asynchronous RL runs stage 'rl_async' (the "
                     "indexer frozen, loss double_sided_is)")
  loop.validate_config(c)
  try:
    context_lib.ContextPolicy(**c.rl.context)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.rl.context={dict(c.rl.context)}: {e}") from None
  tasks_lib.from_config(c.rl)


def rollout_devices(n_trainer: int, n_workers: int, per_worker: int) -> list[list[int]]:
  """Each worker's device indices: `per_worker` devices each from those after the trainer's
  first `n_trainer` (round robin over them; all devices when none is left)."""
  n = jax.device_count()
  pool = list(range(n_trainer, n)) or list(range(n))
  return [[pool[(w * per_worker + j) % len(pool)] for j in range(per_worker)]
          for w in range(n_workers)]


class Prompts:
  """The task's training prompts as an endless indexed stream (chunks of distinct draws)."""

  def __init__(self, task, seed: int, chunk: int = 512):
    self.task, self.seed, self.chunk = task, seed, chunk
    self._cache: dict = {}

  def __getitem__(self, index: int):
    c = index // self.chunk
    if c not in self._cache:
      self._cache = {c: self.task.problems("train", self.chunk,
                                           seed_of(self.seed, 7, c))}
    return self._cache[c][index % self.chunk]


@dataclasses.dataclass
class Group:
  """A finished group on the trainer's side: its rollouts (each a list of segments)."""
  group_id: str
  prompt_index: int
  rollouts: list
  worker: int


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
  length = batches.padded_length(max(s.length for s in segs), context)
  batch = traj_lib.make_batch(segs + [segs[0]] * pad, advs + [0.0] * pad, length=length)
  if pad:
    batch.loss_mask[len(segs):] = 0.0
    batch.versions[len(segs):] = -1
  return batch, segs


def consistency(logprobs, snapshots: dict, batch, segs, dev=None) -> dict:
  """Train/rollout agreement, each token under the version that sampled it: log-prob |diff|
  (max, mean), top-k mismatches (positions whose engine top-k set differs in some layer) and
  MoE routing mismatches ((token, layer) pairs whose experts differ; 0 under routing replay,
  whose experts `dev` carries). dev: `batch` on the trainer's devices (default: placed here
  on the default device)."""
  if dev is None:
    dev = {k: jnp.asarray(getattr(batch, k)) for k in ("tokens", "positions", "segment_ids")}
  mask = batch.loss_mask > 0
  diffs, counts, unmeasured = [], np.zeros(4, np.int64), 0
  for v in sorted(set(batch.versions[mask].tolist())):
    sel = mask & (batch.versions == v)
    if v not in snapshots:
      unmeasured += int(sel.sum())
      continue
    logp, _, topk, experts = logprobs(snapshots[v], dev)
    diffs.append(np.abs(batch.rollout_logp[sel] - np.asarray(logp, np.float64)[sel]))
    # The top-k and the experts at position p made the logits of the token at p + 1: compare
    # where that token was sampled by version v.
    mine = []
    for tr in segs:
      ok = lambda p, tr=tr: p + 1 < len(tr.versions) and tr.versions[p + 1] == v
      mine.append(dataclasses.replace(
          tr, topk={p: x for p, x in (tr.topk or {}).items() if ok(p)},
          routing={p: x for p, x in (tr.routing or {}).items() if ok(p)}))
    counts += (*policy.topk_mismatches(mine, topk), *policy.routing_mismatches(mine, experts))
  d = np.concatenate(diffs) if diffs else np.zeros(0)
  return {"logp_abs_diff_max": float(d.max(initial=0.0)),
          "logp_abs_diff_mean": float(d.mean()) if d.size else 0.0,
          **consistency_lib.mismatch_metrics(*(int(x) for x in counts)),
          "routing_bytes_per_token": traj_lib.routing_bytes_per_token(segs),
          "logp_unmeasured_tokens": float(unmeasured)}


class Control:
  """The trainer's counters and queues that a checkpoint holds (besides params, optimizer):
  also the ledger's length at the save (what a resume keeps of it, rl/orchestration/ledger.py) and
  the metrics' running totals (`totals`: counts, staleness histogram, wall, idle and compile
  time), which a resumed run continues from."""

  def __init__(self, seed: int):
    self.update = self.version = self.consumed = self.admitted = self.cursor = 0
    self.requeue: collections.deque = collections.deque()   # pristine prompt indices
    self.rng = np.random.default_rng(seed_of(seed, 11))
    self.ledger_lines: int | None = None      # None: a checkpoint from before the field
    self.totals: dict = {}

  def to_json(self, in_flight, ledger_lines: int, totals: dict) -> dict:
    return {"update": self.update, "version": self.version, "consumed": self.consumed,
            "admitted": self.admitted, "cursor": self.cursor,
            "requeue": list(self.requeue) + sorted(in_flight),
            "rng": self.rng.bit_generator.state, "ledger_lines": ledger_lines,
            "totals": totals}

  def load(self, d: dict):
    for f in ("update", "version", "consumed", "admitted", "cursor"):
      setattr(self, f, int(d[f]))
    self.requeue = collections.deque(int(i) for i in d["requeue"])
    self.rng.bit_generator.state = d["rng"]
    self.ledger_lines = d.get("ledger_lines")
    self.totals = d.get("totals") or {}



# config.rl.snapshots -> the store Ray actors read versions from (files in the workdir).
SNAPSHOT_STORES = {"sharded": snapshots_lib.ShardedWeights, "file": weights_lib.FileWeights}


def make_backend(c, workdir):
  """(backend, weights store) for config.rl.backend: threads of this process pulling device
  arrays (`DeviceWeights`), or Ray actors or the jax.distributed cluster's other processes
  reading snapshots (config.rl.snapshots)."""
  if c.rl.backend == "local":
    from glm5_jax.rl.orchestration import local_backend  # pylint: disable=g-import-not-at-top
    store = weights_lib.DeviceWeights()
    return local_backend.LocalBackend(worker_lib.RolloutWorker, store), store
  store = SNAPSHOT_STORES[c.rl.snapshots](os.path.join(workdir, "weights"), keep=c.rl.tau + 2)
  if c.rl.backend == "distributed":
    from glm5_jax.rl.orchestration import distributed_backend  # pylint: disable=g-import-not-at-top
    return distributed_backend.DistributedBackend(worker_lib.RolloutWorker, store), store
  from glm5_jax.rl.orchestration import ray_backend  # pylint: disable=g-import-not-at-top
  env = None
  if c.rl.rollout_devices > 1:            # the actor's own fake CPU devices
    env = {"XLA_FLAGS": ray_backend.worker_env()["XLA_FLAGS"] +
           f" --xla_force_host_platform_device_count={c.rl.rollout_devices}"}
  return ray_backend.RayBackend(worker_lib.RolloutWorker, store, env_vars=env,
                                num_cpus=c.rl.ray_cpus_per_worker), store


class AsyncTrainer:
  """The asynchronous loop's trainer side (module docstring): the runner's batch source
  (`train.loop.Source`). One per `run`."""

  name = "rl_async"
  eval_prefix, eval_key, eval_at_start = "heldout_", "success_rate", True
  blocking = True
  items = {"control": ocp.JsonCheckpointHandler()}
  tokens_per_step = seq_len = None
  log_fields = (("v", "version", ".0f"), ("reward", "reward_mean", ".3f"),
                ("success", "success_rate", ".3f"), ("|dlogp| max", "logp_abs_diff_max", ".2e"),
                ("topk mism", "topk_mismatches", ".0f"),
                ("route mism", "routing_mismatch_rate", ".4f"),
                ("masked", "is_masked_frac", ".3f"),
                ("staleness", "staleness_mean", ".2f"),
                ("idle trainer", "trainer_idle_ratio", ".2f"), ("wall s", "wall_s", ".1f"))

  def __init__(self, c, workdir: str, *, clock=time.monotonic):
    self.c, self.r, self.workdir, self.clock = c, c.rl, workdir, clock
    r = c.rl
    self.checkpoint_every, self.eval_every = r.checkpoint_every, r.eval_every
    self.solo = r.backend == "distributed"      # process 0 trains, the others serve rollouts
    self.rd = r.to_dict()
    self.task = tasks_lib.from_config(r)
    self.tok = chat.get_chat_tokenizer(c.data.tokenizer)
    self.prompts = Prompts(self.task, c.seed)
    self.ctl = Control(c.seed)
    self.snapshots: dict = {}                 # version -> params (the last gap_versions)
    self.in_flight: dict = {}                 # group id -> (prompt index, worker)
    self.ready: list[Group] = []
    self.monitor = heartbeat.Monitor(r.heartbeat_timeout_s, clock=clock)
    self.router = routing.Router(r.workers, load_bound=r.route_load_bound, seed=c.seed)
    self.worker_stats: dict = {}
    self.counts = collections.Counter()
    self.spans = collections.Counter()
    self.ledger = self.backend = self.store = self._eval_engine = None
    self.epochs = [0] * r.workers
    self.kill_at = None                       # faults.kill_worker_after_s, on the clock
    self.launched, self.wait_s, self.t_loop = False, 0.0, None
    self.gap_versions = r.gap_versions or r.tau + 1
    self.push_rss_growth = 0.0                # this process's peak RSS growth, last push

  # ------------------------------------------------------------------ the runner's calls
  def model_config(self):
    cfg = convert.model_config_of(self.c.init_from, "config.init_from")
    return cfg.replace(attention_type="sparse")

  def setup(self, cfg, mesh, param_sh) -> None:
    """Checks the config against the model and the meshes; the trainer's jitted forward."""
    c, r = self.c, self.r
    if self.tok.vocab_size > cfg.vocab_size:
      raise ValueError(f"config.data.tokenizer={c.data.tokenizer!r} has "
                       f"{self.tok.vocab_size} ids > the model's vocab_size={cfg.vocab_size}")
    self.cfg, self.mesh, self.param_sh = cfg, mesh, param_sh
    self.sharded = mesh.size > 1
    self.batch_sh = shd.batch_sharding(mesh) if self.sharded else None
    self.rows_multiple = shd.batch_axis_size(mesh)
    self.context = mesh.shape["context"]
    self.worker_devices = rollout_devices(mesh.size if c.num_devices else 0, r.workers,
                                          r.rollout_devices)
    if r.backend == "local" and r.rollout_devices > jax.device_count():
      raise ValueError(f"config.rl.rollout_devices={r.rollout_devices}: this process has "
                       f"{jax.device_count()} devices")
    try:
      shape = dict(zip(shd.MESH_AXES, shd.mesh_shape(dict(r.rollout_mesh), r.rollout_devices)))
    except ValueError as e:
      raise ValueError(f"config.rl.rollout_mesh over config.rl.rollout_devices="
                       f"{r.rollout_devices}: {e}") from None
    n_bat = int(np.prod([shape[a] for a in shd.BATCH_AXES]))
    if r.engine_batch % n_bat:
      raise ValueError(f"config.rl.engine_batch={r.engine_batch}: expected a multiple of the "
                       f"rollout mesh's batch axes ({n_bat}: config.rl.rollout_mesh="
                       f"{dict(r.rollout_mesh)} over {r.rollout_devices} devices)")
    if self.sharded and r.engine_batch % self.rows_multiple:
      raise ValueError(f"config.rl.engine_batch={r.engine_batch}: the evaluation engine runs "
                       f"on the trainer's mesh; expected a multiple of its batch axes "
                       f"({self.rows_multiple})")
    self.heldout = tasks_lib.heldout_problems(self.task, r, c.seed)
    sample = self.heldout + self.task.problems("train", 64, seed_of(c.seed, 12))
    tasks_lib.check_prompts_fit(
        [len(agent_lib.first_prompt(p, self.tok, enable_thinking=r.enable_thinking))
         for p in sample], r, "held-out problems and a sample of training ones")
    self.forward = policy.jitted_forward(cfg, chunk_size=r.logprob_chunk, mesh=mesh,
                                         param_sh=param_sh, batch_sh=self.batch_sh)
    consistency_lib.warn_without_batch_invariance()

  def save_items(self) -> dict:
    in_flight = [i for i, _ in self.in_flight.values()] + [g.prompt_index for g in self.ready]
    return {"control": ocp.args.JsonSave(self.ctl.to_json(in_flight, self.ledger.lines,
                                                          self._totals()))}

  def restore_items(self) -> dict:
    return {"control": ocp.args.JsonRestore()}

  def load(self, restored: dict) -> None:
    self.ctl.load(restored["control"])
    t = self.ctl.totals
    self.counts = collections.Counter(t.get("counts", {}))
    self.spans = collections.Counter({int(k): v for k, v in t.get("spans", {}).items()})
    self.wait_s = float(t.get("wait_s", 0.0))

  def start(self, state, resumed: bool) -> None:
    """Opens the ledger as this run (rl/orchestration/ledger.py: what a killed run wrote after the
    checkpoint is rolled back, what it left open at the checkpoint ledgered dropped)."""
    self._compile0 = timing.compile_seconds()  # count compilations from here ("compile_s")
    self.ledger = self._open_ledger(resumed)

  def prepare(self, state) -> list:
    """Publishes the current version, starts the workers and admits the first groups; then,
    while they compile and sample, compiles the trainer's forward for `rl.warmup_lengths`
    and returns one batch per length for the runner to compile its update on."""
    r = self.r
    self.backend, self.store = make_backend(self.c, self.workdir)
    if hasattr(self.store, "discard_from"):     # on disk: a killed run's later versions
      gone = self.store.discard_from(self.ctl.version) if jax.process_index() == 0 else []
      if jax.process_count() > 1 and not self.solo:   # before any trainer process publishes
        multihost_utils.sync_global_devices("glm5_rl_discard_weights")
      if gone:
        logging.info("[rl_async] removed weight versions %s of an earlier run from %s",
                     gone, self.store.directory)
    self._publish(state.params)
    self.backend.start([self._spec(wid) for wid in range(r.workers)])
    for wid in range(r.workers):
      self.monitor.register(wid)
    self._pump(0.0)
    rows = self._rows(r.groups_per_update * r.group_size)
    out = []
    for t in r.warmup_lengths:
      t = batches.padded_length(t, self.context)
      replay = ({0: np.full((layer_stack.num_moe_layers(self.cfg),
                             self.cfg.num_experts_per_tok), -1, np.int32)}
                if r.routing_replay and batches.has_moe(self.cfg) else None)
      dummy = traj_lib.Trajectory([0] * t, [0.0] * t, [0.0] * t, [-1] * t, routing=replay)
      dev = batches.device_batch(traj_lib.make_batch([dummy] * rows, np.zeros(rows), length=t),
                              self.batch_sh, replay=r.routing_replay)
      jax.block_until_ready(self.forward(state.params, dev))
      out.append(dev)
    if r.faults.kill_worker_after_s > 0:
      self.kill_at = self.clock() + r.faults.kill_worker_after_s
    self.launched, self.t_loop = True, time.perf_counter()
    return out

  def batches(self, state, step: int):
    """Waits until groups_per_update groups pass the staleness rules; their batch (one
    optimizer update) and its train/rollout consistency under each token's version."""
    del state, step
    t0 = time.perf_counter()
    taken = None
    while taken is None:
      self._pump(0.02)
      taken = self._take()
      if taken is None and time.perf_counter() - t0 > self.r.max_wait_s:
        raise RuntimeError(
            f"[rl_async] no update for config.rl.max_wait_s={self.r.max_wait_s}s: "
            f"{len(self.in_flight)} groups in flight, {len(self.ready)} ready, counts "
            f"{dict(self.counts)}, worker errors {self.backend.errors()}")
    self.wait_s += time.perf_counter() - t0
    t1 = time.perf_counter()
    batch, segs = batch_of(taken, self.r.normalize_std, self.rows_multiple, self.context)
    dev = batches.device_batch(batch, self.batch_sh, replay=self.r.routing_replay)
    m = consistency(self.forward, self.snapshots, batch, segs, dev)
    self._taken, self._batch, self._segs = taken, batch, segs
    m.update(consistency_s=time.perf_counter() - t1,
             batch_tokens=float(batch.segment_ids.sum()),
             batch_length=float(batch.tokens.shape[1]))
    return [dev], m

  def after(self, state, step: int, reset_optimizer):
    """Ledgers the consumed groups; every K updates publishes a version and resets the
    optimizer state (GLM-5 §3); the update's host metrics."""
    r, taken = self.r, self._taken
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
    if self.ctl.update != step:
      raise AssertionError(f"update counter {self.ctl.update} != the runner's step {step}")
    if self.ctl.update % r.updates_per_publish == 0:
      self.ctl.version += 1
      self._publish(state.params)
      state = reset_optimizer(state)                   # at every push (GLM-5 §3)
    t = self._totals()
    wall, busy = t["wall_s"], t["busy_s"]
    m = dict(reward_mean=float(rewards.mean()), success_rate=float(np.mean(rewards >= 1.0)),
             staleness_mean=float(np.mean(spans)), staleness_max=float(max(spans)),
             segments=float(len(self._segs)), version=float(self.ctl.version),
             in_flight=float(len(self.in_flight)), ready=float(len(self.ready)))
    m.update({k: float(v) for k, v in self.counts.items()})
    for k in ("pull_bytes", "pull_s", "pull_rss_growth_bytes"):   # the replicas' latest
      m[f"{k}_max"] = float(max([s.get(k, 0.0) for s in self.worker_stats.values()] or [0.0]))
    m.update({f"staleness_hist_{k}": float(v) for k, v in sorted(self.spans.items())})
    cached, prompt = t["prefix_tokens"]
    m.update(trainer_idle_ratio=self.wait_s / max(wall, 1e-9), compile_s=t["compile_s"],
             compiles=float(t["compiles"]),
             rollout_idle_ratio=1.0 - (float(np.mean(busy)) / max(wall, 1e-9) if busy else 0.0),
             prefix_hit_rate=cached / prompt if prompt else 0.0, wall_s=wall,
             **self.store.last_push, push_rss_growth_bytes=self.push_rss_growth)
    return state, m

  def _totals(self) -> dict:
    """The metrics' running totals over every run of this workdir: the checkpoint's
    (`Control.totals`) plus this run's. Counts and histogram are the live counters."""
    base = self.ctl.totals
    wall = base.get("wall_s", 0.0) + (time.perf_counter() - self.t_loop if self.t_loop else 0.0)
    busy = [sum(s.get("busy_s", 0.0) for (w, _), s in self.worker_stats.items() if w == wid)
            for wid in range(self.r.workers)]
    base_busy = base.get("busy_s", [])
    busy = [b + (base_busy[w] if w < len(base_busy) else 0.0) for w, b in enumerate(busy)]
    cached, prompt = base.get("prefix_tokens", [0, 0])
    for s in self.worker_stats.values():
      cached, prompt = cached + s.get("cached_prompt_tokens", 0), prompt + s.get(
          "prompt_tokens", 0)
    compile_s, compiles = timing.compile_seconds()      # this process (local workers too)
    return {"counts": dict(self.counts), "spans": {str(k): v for k, v in self.spans.items()},
            "wall_s": wall, "wait_s": self.wait_s, "busy_s": busy,
            "prefix_tokens": [cached, prompt],
            "compile_s": base.get("compile_s", 0.0) + compile_s - self._compile0[0],
            "compiles": base.get("compiles", 0) + compiles - self._compile0[1]}

  def evaluate(self, state, step: int) -> dict:
    """Greedy multi-turn episodes on held-out problems under the current params, on an
    engine colocated with the trainer (its mesh, its arrays)."""
    t0 = time.perf_counter()
    r = dict(self.rd, faults={"env_crash_rate": 0.0, "slow_env_tail": 0.0},
             env=dict(self.rd["env"], latency_median_s=0.0))
    if self._eval_engine is None:
      devices = list(self.mesh.devices.flat)
      axes = dict(self.mesh.shape) if self.sharded else {"data": 1}
      self._eval_engine = worker_lib.build_engine(self.cfg, state.params, r, self.ctl.version,
                                                  worker_lib.replica_mesh(devices, axes),
                                                  rules=self.c.mesh_rules, rollout=False)
    else:
      self._eval_engine.update_params(state.params, self.ctl.version)
    driver = agent_lib.Driver(self._eval_engine, self.tok, threads=r["tool_threads"],
                              max_new_tokens=r["max_new_tokens"], temperature=0.0)
    try:
      ended = driver.run([worker_lib.make_episode(self.task, p, self.tok, r,
                                                  rollout_id=f"eval/{i}", group_id="eval",
                                                  prompt_index=i)
                          for i, p in enumerate(self.heldout)])
    finally:
      driver.close()
    rewards = np.asarray([ep.reward for ep in ended])
    ev = {"success_rate": float(np.mean(rewards >= 1.0)),
          "reward_mean": float(rewards.mean()), "problems": float(len(ended)),
          "tool_use_rate": float(np.mean([ep.tool_turns > 0 for ep in ended])),
          "eval_s": time.perf_counter() - t0}
    logging.info("[rl_async] update %d held-out success %.4f", step, ev["success_rate"])
    return ev

  def close(self) -> None:
    """Stops the workers; work in flight or not consumed is ledgered dropped ("shutdown");
    the checkpoint's control state re-admits those prompts on resume."""
    if self.backend is not None:        # a worker ends at its next loop check: after at most
      self.backend.shutdown(timeout_s=600)  # one engine step, which may be compiling (a
                                            # thread left in XLA at exit aborts the process)
    if self.ledger is None:
      return
    for gid, (index, _) in self.in_flight.items():
      self.ledger.write(gid, "group", "dropped", reason="shutdown", prompt_index=index)
    for g in self.ready:
      self._drop_group(g.group_id, g.prompt_index, "shutdown", requeue=False,
                       rollouts=g.rollouts)
    self.ledger.close()
    self.ledger = None

  # ------------------------------------------------------------------ workers
  def _rows(self, n: int) -> int:
    return -(-traj_lib.bucket_length(n, minimum=1) // self.rows_multiple) * self.rows_multiple

  def _spec(self, wid: int) -> dict:
    local = self.r.backend == "local"
    return {"worker_id": wid, "epoch": self.epochs[wid],
            "devices": self.worker_devices[wid] if local else None,
            "mesh": dict(self.r.rollout_mesh), "rules": self.c.mesh_rules,
            "model_config": config_lib.model_fields(self.cfg), "rl": self.rd,
            "tokenizer": self.c.data.tokenizer, "seed": self.c.seed}

  def _publish(self, params):
    """Version ctl.version: a copy of `params` on the trainer's devices (the runner donates
    its own buffers to the next update), kept for the consistency measurement and handed to
    the store."""
    v = self.ctl.version
    snap = jax.tree.map(jnp.copy, params)
    self.snapshots[v] = snap
    for old in [k for k in self.snapshots if k <= v - self.gap_versions]:
      del self.snapshots[old]
    with memory.Peak() as peak:
      self.store.publish(snap, v)
    self.push_rss_growth = float(peak.growth)

  def _open_ledger(self, resumed: bool):
    """The workdir's ledger, opened as this run (rl/orchestration/ledger.py): it keeps what the
    ledger held at the checkpoint it resumes from (all of it for a checkpoint from before the
    ledger's length was saved; none without a finished checkpoint), rolls the rest back,
    ledgers what is still open at the checkpoint as dropped ("shutdown"), and continues
    group ids after every id the file holds. Never truncated."""
    path = os.path.join(self.workdir, "rollouts.jsonl")
    ledger = ledger_lib.Ledger.open(path, clock=self.clock)
    keep = 0
    if resumed:
      keep = ledger.lines if self.ctl.ledger_lines is None else self.ctl.ledger_lines
      if keep > ledger.lines:
        raise ValueError(f"{path} has {ledger.lines} lines, but the checkpoint of update "
                         f"{self.ctl.update} was saved when it had {keep}: the ledger was "
                         "replaced or cut; restore it, or start a new --workdir")
    if ledger.lines:
      partial = sorted(d for d in os.listdir(os.path.join(self.workdir, "checkpoints"))
                       if "tmp" in d) if os.path.isdir(
                           os.path.join(self.workdir, "checkpoints")) else []
      logging.warning(
          "[rl_async] %s: run %d continues from %s; the ledger's %d lines after line %d "
          "(an earlier run's work after that point) are rolled back, kept in the file%s",
          path, ledger.run, f"update {self.ctl.update}" if resumed else
          "update 0 (no finished checkpoint)", ledger.lines - keep, keep,
          f" (unfinished checkpoints: {partial})" if partial else "")
    ledger.begin(self.ctl.update, keep, version=self.ctl.version)
    for kind, ids in ledger_lib.pending(path).items():
      for i in ids:
        ledger.write(i, kind, "dropped", reason="shutdown")
    gids = [int(e["id"][1:]) for e in ledger_lib.events(path)
            if e.get("kind") == "group" and e.get("event") == "admitted"]
    self.ctl.admitted = max([self.ctl.admitted] + [g + 1 for g in gids])
    return ledger

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
                             "seed": seed_of(self.c.seed, 13, self.ctl.admitted)})

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


def run(c, workdir: str, *, clock=time.monotonic) -> dict | None:
  """Runs asynchronous agentic RL until `c.total_steps` updates (resuming from `workdir`).
  With backend "distributed", process 0 trains and returns the metrics; every other process
  serves a rollout worker until the trainer ends and returns None."""
  validate(c)
  if c.rl.backend == "distributed":
    loop.maybe_initialize_distributed(c)
    if jax.process_count() < 2:
      raise ValueError("config.rl.backend='distributed' runs the trainer in process 0 and "
                       "worker i in process i + 1: set config.distributed.num_processes="
                       f"{c.rl.workers + 1} (and coordinator_address, process_id)")
    from glm5_jax.rl.orchestration import distributed_backend  # pylint: disable=g-import-not-at-top
    if jax.process_index() > 0:
      return distributed_backend.serve()
    try:
      return loop.run(c, workdir, AsyncTrainer(c, workdir, clock=clock))
    finally:
      distributed_backend.finish()
  return loop.run(c, workdir, AsyncTrainer(c, workdir, clock=clock))


def read_control(workdir: str, update: int) -> dict:
  """The control state saved with checkpoint `update` of an asynchronous run (item
  "control": counters, prompt cursor, the prompts to re-admit first)."""
  with ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                             item_handlers={"control": ocp.JsonCheckpointHandler()}) as m:
    return m.restore(update, args=ocp.args.Composite(control=ocp.args.JsonRestore()))["control"]
