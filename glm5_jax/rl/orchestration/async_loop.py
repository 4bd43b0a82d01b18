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
trajectory id goes through the ledger (`WORKDIR/rollouts.jsonl`, `ledger.audit`). Steps 1-3
and the restarts are the trainer's `group_stream.GroupStream`; the backends `backends.py`; the
counters a checkpoint holds `control.py`.

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
import os
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
from glm5_jax.rl.algorithm import trajectory as traj_lib
from glm5_jax.rl.algorithm.seeds import seed_of
from glm5_jax.rl.envs import agent as agent_lib
from glm5_jax.rl.envs import context as context_lib
from glm5_jax.rl.envs import tasks as tasks_lib
from glm5_jax.rl.orchestration import backends
from glm5_jax.rl.orchestration import control
from glm5_jax.rl.orchestration import ledger as ledger_lib
from glm5_jax.rl.orchestration import rollout_worker as worker_lib
from glm5_jax.rl.orchestration import staleness
from glm5_jax.rl.orchestration.group_stream import GroupStream
from glm5_jax.train import loop


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
    self.ctl = control.Control(c.seed)
    self.stream = GroupStream(r, c.seed, self.ctl, control.Prompts(self.task, c.seed),
                              clock=clock)
    self.snapshots: dict = {}                 # version -> params (the last gap_versions)
    self.spans = collections.Counter()
    self.store = self._eval_engine = None
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
    self.worker_devices = backends.rollout_devices(mesh.size if c.num_devices else 0,
                                                   r.workers, r.rollout_devices)
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
    s = self.stream
    in_flight = [i for i, _ in s.in_flight.values()] + [g.prompt_index for g in s.ready]
    return {"control": ocp.args.JsonSave(self.ctl.to_json(in_flight, s.ledger.lines,
                                                          self._totals()))}

  def restore_items(self) -> dict:
    return {"control": ocp.args.JsonRestore()}

  def load(self, restored: dict) -> None:
    self.ctl.load(restored["control"])
    t = self.ctl.totals
    self.stream.counts = collections.Counter(t.get("counts", {}))
    self.spans = collections.Counter({int(k): v for k, v in t.get("spans", {}).items()})
    self.wait_s = float(t.get("wait_s", 0.0))

  def start(self, state, resumed: bool) -> None:
    """Opens the ledger as this run (rl/orchestration/ledger.py: what a killed run wrote after the
    checkpoint is rolled back, what it left open at the checkpoint ledgered dropped)."""
    self._compile0 = timing.compile_seconds()  # count compilations from here ("compile_s")
    self.stream.ledger = self._open_ledger(resumed)

  def prepare(self, state) -> list:
    """Publishes the current version, starts the workers and admits the first groups; then,
    while they compile and sample, compiles the trainer's forward for `rl.warmup_lengths`
    and returns one batch per length for the runner to compile its update on."""
    r = self.r
    self.stream.backend, self.store = backends.make_backend(self.c, self.workdir)
    if hasattr(self.store, "discard_from"):     # on disk: a killed run's later versions
      gone = self.store.discard_from(self.ctl.version) if jax.process_index() == 0 else []
      if jax.process_count() > 1 and not self.solo:   # before any trainer process publishes
        multihost_utils.sync_global_devices("glm5_rl_discard_weights")
      if gone:
        logging.info("[rl_async] removed weight versions %s of an earlier run from %s",
                     gone, self.store.directory)
    self._publish(state.params)
    self.stream.backend.start([self._spec(wid) for wid in range(r.workers)])
    for wid in range(r.workers):
      self.stream.monitor.register(wid)
    self.stream.pump(0.0)
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
      self.stream.kill_at = self.clock() + r.faults.kill_worker_after_s
    self.launched, self.t_loop = True, time.perf_counter()
    return out

  def batches(self, state, step: int):
    """Waits until groups_per_update groups pass the staleness rules; their batch (one
    optimizer update) and its train/rollout consistency under each token's version."""
    del state, step
    t0 = time.perf_counter()
    taken = None
    while taken is None:
      self.stream.pump(0.02)
      taken = self.stream.take()
      if taken is None and time.perf_counter() - t0 > self.r.max_wait_s:
        raise RuntimeError(
            f"[rl_async] no update for config.rl.max_wait_s={self.r.max_wait_s}s: "
            f"{len(self.stream.in_flight)} groups in flight, {len(self.stream.ready)} ready, "
            f"counts {dict(self.stream.counts)}, worker errors {self.stream.backend.errors()}")
    self.wait_s += time.perf_counter() - t0
    t1 = time.perf_counter()
    batch, segs = batches.batch_of(taken, self.r.normalize_std, self.rows_multiple, self.context)
    dev = batches.device_batch(batch, self.batch_sh, replay=self.r.routing_replay)
    m = consistency_lib.per_version_metrics(self.forward, self.snapshots, batch, segs, dev)
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
          self.stream.ledger.write(seg.id, "trajectory", "consumed", group=g.group_id,
                                   update=self.ctl.update)
      self.stream.ledger.write(g.group_id, "group", "consumed", update=self.ctl.update)
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
             in_flight=float(len(self.stream.in_flight)), ready=float(len(self.stream.ready)))
    m.update({k: float(v) for k, v in self.stream.counts.items()})
    for k in ("pull_bytes", "pull_s", "pull_rss_growth_bytes"):   # the replicas' latest
      m[f"{k}_max"] = float(max([s.get(k, 0.0) for s in self.stream.worker_stats.values()]
                                or [0.0]))
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
    stats = self.stream.worker_stats
    busy = [sum(s.get("busy_s", 0.0) for (w, _), s in stats.items() if w == wid)
            for wid in range(self.r.workers)]
    base_busy = base.get("busy_s", [])
    busy = [b + (base_busy[w] if w < len(base_busy) else 0.0) for w, b in enumerate(busy)]
    cached, prompt = base.get("prefix_tokens", [0, 0])
    for s in stats.values():
      cached, prompt = cached + s.get("cached_prompt_tokens", 0), prompt + s.get(
          "prompt_tokens", 0)
    compile_s, compiles = timing.compile_seconds()      # this process (local workers too)
    return {"counts": dict(self.stream.counts),
            "spans": {str(k): v for k, v in self.spans.items()},
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
    if self.stream.backend is not None:        # a worker ends at its next loop check: after at most
      self.stream.backend.shutdown(timeout_s=600)  # one engine step, which may be compiling (a
                                            # thread left in XLA at exit aborts the process)
    if self.stream.ledger is None:
      return
    for gid, (index, _) in self.stream.in_flight.items():
      self.stream.ledger.write(gid, "group", "dropped", reason="shutdown", prompt_index=index)
    for g in self.stream.ready:
      self.stream.drop(g.group_id, g.prompt_index, "shutdown", requeue=False,
                       rollouts=g.rollouts)
    self.stream.ledger.close()
    self.stream.ledger = None

  # ------------------------------------------------------------------ workers
  def _rows(self, n: int) -> int:
    return -(-traj_lib.bucket_length(n, minimum=1) // self.rows_multiple) * self.rows_multiple

  def _spec(self, wid: int) -> dict:
    local = self.r.backend == "local"
    return {"worker_id": wid, "epoch": self.stream.epochs[wid],
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


