"""The training runner: `run(config, workdir, source)` for every stage.

Pretraining, mid-training, the DSA stages, SFT, synchronous GRPO and the asynchronous RL
trainer differ in two things only: their row of the stage table (train/step.py: attention,
what trains, the loss) and where their batches come from (a batch source). Everything else
is here, once:

  * config checks (train/checks.py tables), then jax.distributed (config.distributed or the
    TPU environment), the workdir's lock and the run it holds (train/workdir.py: one run
    per workdir; a resume that changes the run's defining fields refused), the mesh
    `data, fsdp, context, expert, tensor` over the first `config.num_devices` devices;
  * parameters and optimizer state created or restored directly in their shardings (the
    `init_from` checkpoint read per process into them); exact resume from
    WORKDIR/checkpoints/<step>/ (orbax: the TrainState plus the source's items);
  * one jitted `train_step` with explicit in/out shardings and the state donated: the row's
    loss, gradient accumulation over `config.microbatches`, the optimizer update (Muon Split
    under the mesh), the routing-bias update;
  * metrics to WORKDIR/metrics.jsonl and TensorBoard with progress, ETA and MFU (evaluation
    and checkpoint time left out), a non-finite loss or gradient stopping the run with the
    last good checkpoint intact;
  * coordinated preemption (SIGTERM or Ctrl-C on any process stops every process at one
    step with one checkpoint, train/preemption.py), the checkpoint of a step saved before its evaluation,
    a run stopped in between evaluating first when resumed; `profile_steps` writes a
    jax.profiler trace to WORKDIR/profile.

A batch source (`Source` below; train/lm_data.py, rl/orchestration/grpo.py,
rl/orchestration/async_loop.py) gives the model config, checks itself against the mesh, produces
each step's batches (one, or several minibatches each taking one optimizer update, GRPO's), acts
after each step (publishing weights, resetting the optimizer state), evaluates, and names what it
saves with the state.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Protocol

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import convert
from glm5_jax import nn as gnn
from glm5_jax import orbax_io
from glm5_jax import sharding as shd
from glm5_jax.train import checkpoint as ckpt_lib
from glm5_jax.train import checks
from glm5_jax.train import flops
from glm5_jax.train import lm_data
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import preemption
from glm5_jax.train import step as step_lib
from glm5_jax.train import workdir as workdir_lib


class Source(Protocol):
  """What a stage gives the runner (every method public; the runner calls nothing else)."""

  name: str                 # the log prefix
  checkpoint_every: int
  eval_every: int
  eval_prefix: str          # metrics of `evaluate` are written as eval_prefix + key
  eval_key: str             # the key whose presence at a step means "evaluated"
  eval_at_start: bool       # evaluate a fresh run at step 0
  blocking: bool            # each step needs the previous one's result (RL): its updates
                            # are timed ("update_s") and their metrics read every step
  items: dict               # {name: orbax handler} saved with the state
  log_fields: tuple         # (label, metric, format) of the log line (metrics.LM_LOG)
  tokens_per_step: int | None   # tokens one step trains on (None: the step's "batch_tokens")
  seq_len: int | None           # row length for the FLOPs (None: the step's "batch_length")
  solo: bool                # this process trains alone, on its own devices (the cluster's
                            # other processes serve rollouts): no collective involves them

  def model_config(self) -> Any: ...
  def setup(self, cfg, mesh, param_sh) -> None: ...
  def save_items(self) -> dict: ...
  def restore_items(self) -> dict: ...
  def load(self, restored: dict) -> None: ...
  def start(self, state, resumed: bool) -> None: ...
  def prepare(self, state) -> list: ...     # before the first step: batches to compile
  def batches(self, state, step: int) -> tuple[list, dict]: ...
  def after(self, state, step: int, reset_optimizer) -> tuple[Any, dict]: ...
  def evaluate(self, state, step: int) -> dict: ...
  def close(self) -> None: ...


def maybe_initialize_distributed(c) -> None:
  """jax.distributed from config.distributed, or from the environment on a TPU pod slice."""
  d = c.distributed
  if jax.distributed.is_initialized():
    return
  if d.num_processes <= 1 and not d.coordinator_address:
    if "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):   # multi-host TPU VM
      jax.distributed.initialize()
    return
  if d.cpu_collectives:                # CPU processes talk through gloo (WORKSPACE.md)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=d.coordinator_address or None,
                             num_processes=d.num_processes if d.num_processes > 0 else None,
                             process_id=d.process_id if d.process_id >= 0 else None)


def devices(c, solo: bool = False):
  """The devices of the trainer's mesh: the first `config.num_devices` (0: all of them). A
  CPU job that gives other devices to RL rollout workers trains on device 0 alone. `solo`:
  of this process's own devices (its cluster's other processes serve rollouts)."""
  n = c.num_devices
  pool = jax.local_devices() if solo else jax.devices()
  if not isinstance(n, int) or not 0 <= n <= len(pool):
    raise ValueError(f"config.num_devices={n!r}: expected an int in [0, {len(pool)}] "
                     "(0 = every device)")
  if n and jax.process_count() > 1 and n != len(pool) and not solo:
    raise ValueError(f"config.num_devices={n}: a multi-process run trains on every device (0)")
  if solo:
    return pool[:n or None]
  return pool[:n] if n else None


_devices = devices


def check_mesh(cfg, mesh) -> None:
  """The model's heads and experts against the mesh (errors name the field)."""
  if cfg.num_attention_heads % mesh.shape["tensor"]:
    raise ValueError(f"config.mesh.tensor={mesh.shape['tensor']} does not divide "
                     f"num_attention_heads={cfg.num_attention_heads}")
  if cfg.n_routed_experts % mesh.shape["expert"]:
    raise ValueError(f"config.mesh.expert={mesh.shape['expert']} does not divide "
                     f"n_routed_experts={cfg.n_routed_experts}")
  if mesh.shape["context"] > 1 and cfg.attention_impl == "pallas":
    raise ValueError("config.mesh.context > 1 needs model.attention_impl='xla' (context "
                     "parallelism is built and tested on the XLA path; see docs/long_context.md)")


def validate_config(c) -> None:
  """The stage's table of field checks (train/checks.py), before anything is built."""
  checks.validate(c)


# Aliases of the LM source's data helpers (experiments and tests call them from here).
ensure_data, make_dataset = lm_data.ensure_data, lm_data.make_dataset


def abstract_with(shapes, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def _replicated(mesh):
  """Where scalars and replicated leaves live (one device: that device)."""
  return shd.or_one_device(mesh, shd.replicated(mesh))


def _on_mesh(shardings, mesh):
  """Shardings left on fewer devices than the mesh (e.g. step counters) become replicated."""
  devs = set(mesh.devices.flat)
  rep = _replicated(mesh)
  return jax.tree.map(lambda sh: sh if set(sh.device_set) == devs else rep, shardings)


def _scalar(value, sharding):
  return jax.make_array_from_callback((), sharding, lambda _: np.asarray(value, np.int32))


def _init_state(c, cfg, tx, mesh, param_sh, shapes, rules, solo=False):
  """TrainState created in its shardings: `init_from`'s params read into them, or drawn on
  the host per shard, or under jit."""
  how = c.get("param_init", "auto")
  if how == "auto":
    how = "host" if jax.default_backend() == "cpu" else "jit"
  if c.init_from:
    params = convert.load_params(c.init_from, cfg, param_sh, mesh=mesh, rules=rules, solo=solo)
  elif how == "host":
    host = gnn.init_params(cfg, c.seed)
    params = jax.tree.map(lambda x, sh: jax.make_array_from_callback(
        x.shape, sh, lambda idx, x=x: np.asarray(x)[idx]), host, param_sh)
  else:
    # GLM5.init traces the model on dummy tokens inside the mesh: their batch must divide
    # over the batch axes (the expert-parallel shard_map splits it), their length over
    # 2 * context. The parameters do not depend on the dummy's shape.
    tokens = jnp.zeros((shd.batch_axis_size(mesh), max(8, 2 * mesh.shape["context"])),
                       jnp.int32)
    params = jax.jit(lambda k: flax.linen.unbox(gnn.GLM5(cfg).init(k, tokens)["params"]),
                     out_shardings=param_sh)(jax.random.PRNGKey(c.seed))
  opt_state = jax.jit(tx.init)(params)
  opt_state = jax.device_put(opt_state,
                             _on_mesh(jax.tree.map(lambda x: x.sharding, opt_state), mesh))
  rep = _replicated(mesh)
  return step_lib.TrainState(
      step=_scalar(0, rep), params=params, opt_state=opt_state,
      rng=jax.device_put(jax.random.key_data(jax.random.PRNGKey(c.seed)), rep))


def _abstract_state(tx, mesh, shapes, param_sh):
  abstract_params = abstract_with(shapes, param_sh)
  init_opt = jax.jit(tx.init).lower(abstract_params).compile()
  abstract_opt = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(tx.init, abstract_params), _on_mesh(init_opt.output_shardings, mesh))
  rep = _replicated(mesh)
  return step_lib.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params=abstract_params,
      opt_state=abstract_opt, rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))


class _Timed:
  """Wall time of a block (after the pending steps finish), excluded from throughput."""

  def __init__(self, progress, state):
    self.progress, self.state = progress, state

  def __enter__(self):
    jax.block_until_ready(self.state)
    self.t0 = time.perf_counter()

  def __exit__(self, *exc):
    self.progress.exclude(time.perf_counter() - self.t0)


def _agree(flag: bool, solo: bool) -> bool:
  """Process 0's decision, for all processes (it alone holds metrics.jsonl)."""
  if jax.process_count() == 1 or solo:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _profile(c, workdir: str, step: int, tracing: bool) -> bool:
  """Starts / stops the jax.profiler trace of steps profile_steps[0]..[1]-1 (process 0,
  WORKDIR/profile, for TensorBoard's profile plugin). Returns whether it is tracing."""
  ps = c.get("profile_steps") or None
  if ps is None or jax.process_index() != 0:
    return False
  if not tracing and ps[0] <= step < ps[1]:
    jax.profiler.start_trace(os.path.join(workdir, "profile"))
    return True
  if tracing and step >= ps[1]:
    jax.profiler.stop_trace()
    logging.info("profile of steps %d..%d in %s", ps[0], ps[1] - 1,
                 os.path.join(workdir, "profile"))
    return False
  return tracing


def _mean_rows(per_batch: list[dict]) -> dict:
  """One step's metrics: the mean over its minibatches' metrics (host floats)."""
  if len(per_batch) == 1:
    return {k: float(v) for k, v in per_batch[0].items()}
  return {k: float(np.mean([float(x[k]) for x in per_batch])) for k in per_batch[0]}


def run(c, workdir: str, source: Source | None = None) -> dict:
  """Trains `c.total_steps` steps of stage `c.stage` in `workdir` (resuming if possible),
  with batches from `source` (default: the corpus or conversations of an LM stage).

  Returns the final metrics (last train step and evaluation); a run already finished returns
  them read back from its metrics.jsonl. SIGTERM (or SIGINT) on any process stops every
  process at one step with one checkpoint, then raises `preemption.Preempted` (exit 0 when
  uncaught).
  """
  ckpt_lib.quiet_orbax()
  validate_config(c)
  if source is None and step_lib.get_stage(c.stage).loss != "lm":
    raise ValueError(f"config.stage={c.stage!r} trains on rollouts, not a corpus: run it with "
                     "`python -m experiments.rl` (glm5_jax.rl.orchestration.grpo) or "
                     "`python -m experiments.rl_async` (glm5_jax.rl.orchestration.async_loop)")
  maybe_initialize_distributed(c)
  held = claim(c, workdir, source is not None and source.solo)   # before anything is written
  # After jax.distributed, whose preemption service installs its own SIGTERM handler; before
  # compiling, so that a signal then stops the run after its first step.
  try:
    source = lm_data.LMSource(c) if source is None else source
    with preemption.Preemption(solo=source.solo) as preempt:
      try:
        return _run(c, workdir, source, preempt)
      finally:
        source.close()
  finally:
    if held:
      workdir_lib.release(held)


def claim(c, workdir: str, solo: bool = False) -> str | None:
  """Process 0 locks the workdir and checks the run it holds (train/workdir.py); the other
  processes join, raising too if process 0 was refused. The lock's path (process 0) or
  None."""
  held, err = None, None
  if jax.process_index() == 0:
    try:
      held = workdir_lib.acquire(workdir)
      workdir_lib.check_run(workdir, c)
    except (workdir_lib.WorkdirInUse, workdir_lib.ChangedRun) as e:
      if held:
        workdir_lib.release(held)
      held, err = None, e
  if jax.process_count() > 1 and not solo:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    ok = int(multihost_utils.broadcast_one_to_all(np.int32(err is None)))
    if not ok and err is None:
      err = RuntimeError(f"process 0 refused workdir {workdir!r} (its log says why)")
  if err is not None:
    raise err
  return held


def _run(c, workdir: str, source: Source, preempt) -> dict:
  mesh = shd.make_mesh(dict(c.mesh), devices(c, source.solo))
  cfg = source.model_config()
  check_mesh(cfg, mesh)
  rules = shd.rules_from_config(c.mesh_rules)
  shapes, specs = gnn.abstract_params(cfg)
  param_sh = shd.param_shardings(specs, mesh, rules)
  shd.check_divisible(shapes, param_sh, mesh)
  param_sh = jax.tree.map(functools.partial(shd.or_one_device, mesh), param_sh,
                          is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  step_lib.check_qat(c, shapes)
  source.setup(cfg, mesh, param_sh)
  orbax_io.check_model_config(workdir, cfg)
  tx = step_lib.make_optimizer(c, param_sh)
  stage = c.stage
  mngr = ckpt_lib.manager(workdir, keep=c.keep_checkpoints, async_save=c.async_checkpoints,
                          items=source.items, solo=source.solo)
  latest, state = None, None
  with jax.set_mesh(mesh):
    if mngr.all_steps():
      latest, out = ckpt_lib.restore_latest(
          mngr, _abstract_state(tx, mesh, shapes, param_sh),
          what=f"config.stage={stage!r} with config.optimizer={c.optimizer!r}",
          items=source.restore_items(), solo=source.solo)
      if latest is not None:
        state = out["state"]
        source.load(out)
    if latest is None:
      state = _init_state(c, cfg, tx, mesh, param_sh, shapes, rules, source.solo)
    else:
      logging.info("resumed from %s at step %d", mngr.directory, latest)
      if latest > c.total_steps:
        mngr.close()
        raise ValueError(f"config.total_steps={c.total_steps} is below the step {latest} of "
                         f"the checkpoint in {mngr.directory}: expected >= {latest}")

  state_sh = jax.tree.map(lambda x: x.sharding, state)
  batch_sh = shd.or_one_device(mesh, shd.batch_sharding(mesh))
  bias_rate = c.bias_update_rate if step_lib.get_stage(stage).lm_loss else 0.0
  train_fn = jax.jit(
      functools.partial(step_lib.train_step, cfg=cfg, stage=stage, tx=tx,
                        bias_rate=bias_rate, microbatches=c.microbatches,
                        hp=step_lib.loss_hparams(c)),
      in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=(0,))
  fresh_opt = jax.jit(tx.init, out_shardings=state_sh.opt_state)
  reset_optimizer = lambda st: st.replace(opt_state=fresh_opt(st.params))
  schedule = step_lib.make_schedule(c)
  rep = _replicated(mesh)
  start = int(jax.device_get(state.step))
  writer = metrics_lib.MetricWriter(workdir, tensorboard=c.tensorboard,
                                    resume_step=start if latest is not None else -1)
  progress = metrics_lib.Progress(start, c.total_steps, source.tokens_per_step or 0)
  pending, last = [], {}
  window = {"tokens": 0.0, "length": source.seq_len or 0}

  def flush(step, log: bool):
    nonlocal pending, last
    rows = []
    for s, per_batch, host in jax.device_get(pending):
      m = _mean_rows(per_batch)
      if not all(np.isfinite(v) for v in m.values()):
        with ckpt_lib.saving(mngr, workdir):
          mngr.wait_until_finished()
        raise FloatingPointError(
            f"non-finite loss or gradient at step {s} ({m}); stopping. The last good "
            f"checkpoint ({mngr.latest_step()}) in {workdir} is intact.")
      m["learning_rate"] = float(schedule(s - 1))
      m.update({k: float(v) for k, v in host.items()})
      rows.append((s, m))
    pending = []
    if rows:
      p = progress.update(step, tokens=None if source.tokens_per_step else window["tokens"])
      fpt = flops.flops_per_token(cfg, int(window["length"]) or 1, stage)
      rows[-1][1].update(p, est_mfu=flops.mfu(p["tokens_per_s"], fpt, mesh.size,
                                                c.peak_tflops))
      window["tokens"] = 0.0
      for s, m in rows:
        writer.write(s, m)
      last = dict(rows[-1][1])
      if log:
        metrics_lib.log_line(source.name, step, c.total_steps, last, p, source.log_fields)
    writer.flush()

  def eval_and_write(step):
    ev = source.evaluate(state, step)
    writer.write(step, ev, prefix=source.eval_prefix)
    writer.flush()
    last.update({f"{source.eval_prefix}{k}": v for k, v in ev.items()})

  eval_due = lambda step: step % source.eval_every == 0 or step == c.total_steps
  eval_key = source.eval_prefix + source.eval_key
  # A fresh run evaluates first if its source says so; one stopped between a checkpoint and
  # its evaluation evaluates first when resumed.
  eval_first = ((start == 0 and source.eval_at_start) or
                (start > 0 and eval_due(start) and
                 _agree(not metrics_lib.has_metric(workdir, start, eval_key), source.solo)))
  tracing, stop = False, False
  try:
    step = start
    if start < c.total_steps or eval_first:
      source.start(state, resumed=latest is not None)
    if eval_first:
      eval_and_write(start)
    if step < c.total_steps:
      for b in source.prepare(state):             # compiled now, not stalling a later step
        with jax.set_mesh(mesh):
          train_fn.lower(state, b).compile()
    while step < c.total_steps:
      tracing = _profile(c, workdir, step, tracing)
      batches, host = source.batches(state, step)
      t0 = time.perf_counter()
      per_batch = []
      # The mesh is set while steps trace: the MoE layers read its `expert` axis to
      # dispatch tokens with an all-to-all (nn/moe_ep.py), the model its `context` axis.
      with jax.set_mesh(mesh):
        for b in batches:
          state, m = train_fn(state, b)
          per_batch.append(m)
      step += 1
      if len(batches) != 1:                       # one step, several optimizer updates
        state = state.replace(step=_scalar(step, rep))
      if source.blocking:
        per_batch = jax.device_get(per_batch)
        host = {**host, "update_s": time.perf_counter() - t0}
      state, after = source.after(state, step, reset_optimizer)
      host = {**host, **after}
      window["tokens"] += host.get("batch_tokens", 0.0)
      window["length"] = source.seq_len or max(window["length"], host.get("batch_length", 0))
      pending.append((step, per_batch, host))
      stop = preempt.should_stop(step)
      save = step % source.checkpoint_every == 0 or step == c.total_steps or stop
      log = step % c.log_every == 0 or save
      if log or source.blocking:
        flush(step, log)                                # also the non-finite check
      if save:                                          # before evaluating: an evaluation
        with _Timed(progress, state), ckpt_lib.saving(mngr, workdir):  # failure loses no
          ckpt_lib.save(mngr, step, state, force=True, items=source.save_items())  # training
      if stop:
        break
      if eval_due(step):
        with _Timed(progress, state):
          eval_and_write(step)
    tracing = _profile(c, workdir, step, tracing)
    with ckpt_lib.saving(mngr, workdir):
      mngr.wait_until_finished()
  finally:
    if tracing:
      jax.profiler.stop_trace()
    writer.close()
    with ckpt_lib.saving(mngr, workdir):              # a save failed in the background
      mngr.close()
  if stop:
    raise preemption.Preempted(step, workdir)
  if start == c.total_steps:                            # finished earlier: read back
    return {**metrics_lib.final_metrics(workdir), **last}
  return last
