"""The training loop: `run(config, workdir)` for every pretraining stage and SFT.

One jitted step with explicit in/out shardings over a `data, fsdp, expert,
tensor` mesh; parameters and optimizer state are created directly in their
shardings; each process feeds its slice of the global batch; orbax saves and
restores everything needed to continue bit for bit. A step's checkpoint is saved before its
evaluation; SIGTERM on any process stops all of them at one step (train/preemption.py);
throughput (tokens/s) leaves out evaluation and checkpoint time; `profile_steps` writes a
jax.profiler trace to WORKDIR/profile.
"""

from __future__ import annotations

import functools
import math
import os
import time

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import sharding as shd
from glm5_jax.data import corpus
from glm5_jax.data import pipeline
from glm5_jax.data import sft
from glm5_jax.train import checkpoint as ckpt_lib
from glm5_jax.train import flops
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import preemption
from glm5_jax.train import step as step_lib


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


def _devices(c):
  """The devices of the mesh: the first `config.num_devices` (0: all of them). A CPU job
  that gives other devices to RL rollout workers trains on device 0 alone, as before."""
  n = c.get("num_devices", 0)
  if not isinstance(n, int) or not 0 <= n <= jax.device_count():
    raise ValueError(f"config.num_devices={n!r}: expected an int in [0, {jax.device_count()}] "
                     "(0 = every device)")
  if n and jax.process_count() > 1:
    raise ValueError(f"config.num_devices={n}: a multi-process run uses every device (0)")
  return jax.devices()[:n] if n else None


def _validate(c, cfg, n_proc: int, mesh) -> None:
  if c.seq_len > cfg.max_position_embeddings:
    raise ValueError(f"config.seq_len={c.seq_len} > model max_position_embeddings="
                     f"{cfg.max_position_embeddings}")
  if c.batch_size % n_proc:
    raise ValueError(f"config.batch_size={c.batch_size} is not divisible by the "
                     f"{n_proc} processes")
  if c.batch_size % shd.batch_axis_size(mesh):
    raise ValueError(f"config.batch_size={c.batch_size} is not divisible by the mesh's batch "
                     f"axes data*fsdp*expert={shd.batch_axis_size(mesh)}")
  if cfg.num_attention_heads % mesh.shape["tensor"]:
    raise ValueError(f"config.mesh.tensor={mesh.shape['tensor']} does not divide "
                     f"num_attention_heads={cfg.num_attention_heads}")
  if cfg.n_routed_experts % mesh.shape["expert"]:
    raise ValueError(f"config.mesh.expert={mesh.shape['expert']} does not divide "
                     f"n_routed_experts={cfg.n_routed_experts}")
  n_ctx = mesh.shape["context"]
  if n_ctx > 1 and c.seq_len % (2 * n_ctx):
    raise ValueError(f"config.seq_len={c.seq_len} is not divisible by 2 * config.mesh.context="
                     f"{2 * n_ctx} (context parallelism cuts each row into 2 * context chunks)")
  m = c.get("microbatches", 1)
  if (not isinstance(m, int) or m < 1 or (c.batch_size // n_proc) % m
      or (c.batch_size // m) % shd.batch_axis_size(mesh)):
    raise ValueError(f"config.microbatches={m!r}: expected an integer >= 1 dividing the batch "
                     f"per process ({c.batch_size // n_proc}), with batch_size / microbatches "
                     f"divisible by the mesh's batch axes ({shd.batch_axis_size(mesh)})")
  if n_ctx > 1 and cfg.attention_impl == "pallas":
    raise ValueError("config.mesh.context > 1 needs model.attention_impl='xla' (context "
                     "parallelism is built and tested on the XLA path; see docs/long_context.md)")


def validate_config(c) -> None:
  """Checks of single config fields, before anything is built (errors name the field)."""
  ckpt_lib.check_run_fields(c, ("total_steps", "log_every", "checkpoint_every", "eval_every",
                                "eval_batches", "loss_chunk"))
  if c.param_init not in ("auto", "host", "jit"):
    raise ValueError(f"config.param_init={c.param_init!r}: expected 'auto', 'host' or 'jit'")
  ps = c.get("profile_steps") or None
  if ps is not None and (len(ps) != 2 or not 0 <= ps[0] < ps[1]):
    raise ValueError(f"config.profile_steps={ps!r}: expected () or (start, stop) with "
                     "0 <= start < stop (steps start..stop-1 are traced), e.g. "
                     "--config.profile_steps='(10, 13)'")
  n = c.get("num_devices", 0)       # no JAX call here: jax.distributed is not started yet
  if not isinstance(n, int) or isinstance(n, bool) or n < 0:
    raise ValueError(f"config.num_devices={n!r}: expected an int >= 0 (0 = every device)")


_DATA = {"corpus": corpus, "conversations": sft}     # a stage's data -> its module


def _data_module(c):
  return _DATA[step_lib.get_stage(c.stage).data]


def ensure_data(c) -> dict:
  """Prepares the stage's data on first use (process 0), then reads its metadata.

  Pretraining stages read the tokenized corpus (`corpus.prepare` of `data.source_dir`);
  `sft` reads conversations (`sft.prepare` of `data.sources`, JSONL).
  """
  d, mod = c.data, _data_module(c)
  if not os.path.exists(os.path.join(d.dir, corpus.META)):
    if not d.prepare_if_missing:
      mod.load_meta(d.dir)                             # raises the "prepare" error
    if not 0 < d.val_fraction < 1:
      raise ValueError(f"config.data.val_fraction={d.val_fraction}: expected in (0, 1) to "
                       f"prepare {d.dir} (the held-out evaluation needs a validation split)")
    if jax.process_index() == 0:
      logging.info("preparing %s -> %s", d.get("sources") or d.source_dir or "<stdlib>", d.dir)
      if mod is sft:
        sft.prepare(d.sources, d.dir, tokenizer=d.tokenizer, val_fraction=d.val_fraction)
      else:
        corpus.prepare(d.source_dir or corpus.default_source_dir(), d.dir,
                       tokenizer=d.tokenizer, pattern=d.pattern, val_fraction=d.val_fraction,
                       num_shards=d.num_shards, max_files=d.max_files)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("glm5_prepare_data")
  if mod is sft:
    meta = sft.ensure(d.dir, d.sources, tokenizer=d.tokenizer, val_fraction=d.val_fraction)
  else:
    meta = corpus.ensure(d.dir, source_dir=d.source_dir, tokenizer=d.tokenizer,
                         pattern=d.pattern, val_fraction=d.val_fraction,
                         num_shards=d.num_shards, max_files=d.max_files)
  val = meta.get("splits", {}).get("validation", {})
  if "tokens" in val and val["tokens"] < c.seq_len + 1:
    raise ValueError(f"config.data.dir={d.dir!r}: its validation split holds {val['tokens']} "
                     f"tokens, fewer than one row of config.seq_len={c.seq_len}; prepare it "
                     "again with a larger config.data.val_fraction")
  return meta


def make_dataset(c, split: str, *, seed: int, shuffle: bool = True):
  """The stage's grain rows for this process: packed documents, or packed conversations."""
  n_proc, p_idx = jax.process_count(), jax.process_index()
  kw = dict(seq_len=c.seq_len, batch_per_process=c.batch_size // n_proc, seed=seed,
            process_index=p_idx, process_count=n_proc, shuffle=shuffle, repeat=True)
  if _data_module(c) is sft:
    return sft.packed_dataset(c.data.dir, split, **kw)
  return pipeline.packed_dataset(c.data.dir, split, shard=c.data.shard, **kw)


def _model_config(c):
  cfg = config_lib.from_config_dict(c.model)
  return cfg


def _to_global(batch, sharding):
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def _init_state(c, cfg, tx, mesh, param_sh, abstract):
  """TrainState created in its shardings (params on host per shard, or under jit)."""
  how = c.param_init
  if how == "auto":
    how = "host" if jax.default_backend() == "cpu" else "jit"
  if c.init_from:               # the other run's params only, read into their shardings
    params = ckpt_lib.restore_params(c.init_from, abstract_with(abstract, param_sh))
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
  rep = shd.replicated(mesh)
  return step_lib.TrainState(
      step=jax.device_put(jnp.zeros((), jnp.int32), rep), params=params, opt_state=opt_state,
      rng=jax.device_put(jax.random.key_data(jax.random.PRNGKey(c.seed)), rep))


def _on_mesh(shardings, mesh):
  """Shardings left on fewer devices than the mesh (e.g. step counters) become replicated."""
  devices = set(mesh.devices.flat)
  rep = shd.replicated(mesh)
  return jax.tree.map(lambda sh: sh if set(sh.device_set) == devices else rep, shardings)


def abstract_with(shapes, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, shardings)


def evaluate(c, cfg, params, eval_fn, meta, batch_sh) -> dict:
  """Held-out loss (nats per target token) over `eval_batches` fixed batches, and bits per
  byte where the corpus counts bytes (not for conversations)."""
  if c.eval_batches < 1:
    raise ValueError(f"config.eval_batches={c.eval_batches}: expected >= 1")
  it = iter(make_dataset(c, "validation", seed=0, shuffle=False))
  nll, tok, kl = 0.0, 0.0, 0.0
  for _ in range(c.eval_batches):
    out = jax.device_get(eval_fn(params, _to_global(next(it), batch_sh)))
    nll, tok, kl = nll + float(out["nll_sum"]), tok + float(out["tokens"]), kl + float(out["indexer_kl"])
  loss = nll / max(tok, 1.0)
  res = {"loss": loss, "indexer_kl": kl / c.eval_batches}
  v = meta["splits"]["validation"]
  if "bytes" in v:
    res["bits_per_byte"] = loss / math.log(2) / (v["bytes"] / max(v["tokens"], 1))
  return res


class _Timed:
  """Wall time of a block (after the pending steps finish), excluded from throughput."""

  def __init__(self, progress, state):
    self.progress, self.state = progress, state

  def __enter__(self):
    jax.block_until_ready(self.state)
    self.t0 = time.perf_counter()

  def __exit__(self, *exc):
    self.progress.exclude(time.perf_counter() - self.t0)


def _agree(flag: bool) -> bool:
  """Process 0's decision, for all processes (it alone holds metrics.jsonl)."""
  if jax.process_count() == 1:
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


def run(c, workdir: str) -> dict:
  """Trains `c.total_steps` steps of stage `c.stage` in `workdir` (resuming if possible).

  Returns the final metrics (last train step and held-out evaluation); a run already
  finished returns them read back from its metrics.jsonl. SIGTERM on any process stops
  every process at one step with one checkpoint, then raises `preemption.Preempted`
  (exit 0 when uncaught).
  """
  ckpt_lib.quiet_orbax()
  validate_config(c)
  maybe_initialize_distributed(c)
  # After jax.distributed, whose preemption service installs its own SIGTERM handler; before
  # compiling, so that a signal then stops the run after its first step.
  with preemption.Preemption() as preempt:
    return _run(c, workdir, preempt)


def _run(c, workdir: str, preempt) -> dict:
  cfg = _model_config(c)
  if step_lib.get_stage(c.stage).runner != "loop":
    raise ValueError(f"config.stage={c.stage!r} trains on rollouts, not a corpus: run it with "
                     "`python -m experiments.rl` (glm5_jax.rl.grpo)")
  mesh = shd.make_mesh(dict(c.mesh), _devices(c))
  n_proc = jax.process_count()
  _validate(c, cfg, n_proc, mesh)
  meta = ensure_data(c)
  if meta["vocab_size"] > cfg.vocab_size:
    raise ValueError(f"data tokenizer vocab {meta['vocab_size']} > model vocab_size "
                     f"{cfg.vocab_size}")
  ckpt_lib.check_model_config(workdir, cfg)

  rules = shd.rules_from_config(c.mesh_rules)
  shapes, specs = gnn.abstract_params(cfg)
  param_sh = shd.param_shardings(specs, mesh, rules)
  shd.check_divisible(shapes, param_sh, mesh)
  batch_sh = shd.batch_sharding(mesh)
  tx = step_lib.make_optimizer(c)

  mngr = ckpt_lib.manager(workdir, keep=c.keep_checkpoints, async_save=c.async_checkpoints)
  data_iter = iter(make_dataset(c, "train", seed=c.seed))
  latest, state = None, None
  with jax.set_mesh(mesh):
    if mngr.all_steps():
      abstract_params = abstract_with(shapes, param_sh)
      init_opt = jax.jit(tx.init).lower(abstract_params).compile()
      abstract_opt = jax.tree.map(
          lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
          jax.eval_shape(tx.init, abstract_params), _on_mesh(init_opt.output_shardings, mesh))
      abstract_state = step_lib.TrainState(
          step=jax.ShapeDtypeStruct((), jnp.int32, sharding=shd.replicated(mesh)),
          params=abstract_params, opt_state=abstract_opt,
          rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=shd.replicated(mesh)))
      latest, state = ckpt_lib.restore_latest(
          mngr, abstract_state, data_iter,
          what=f"config.stage={c.stage!r} with config.optimizer={c.optimizer!r}")
    if latest is None:
      state = _init_state(c, cfg, tx, mesh, param_sh, shapes)
    else:
      logging.info("resumed from %s at step %d", mngr.directory, latest)
      if latest > c.total_steps:
        mngr.close()
        raise ValueError(f"config.total_steps={c.total_steps} is below the step {latest} of "
                         f"the checkpoint in {mngr.directory}: expected >= {latest}")

  state_sh = jax.tree.map(lambda x: x.sharding, state)
  train_fn = jax.jit(
      functools.partial(step_lib.train_step, cfg=cfg, stage=c.stage, tx=tx,
                        loss_chunk=c.loss_chunk, bias_rate=c.bias_update_rate,
                        microbatches=c.get("microbatches", 1)),
      in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=(0,))
  eval_fn = jax.jit(functools.partial(step_lib.eval_step, cfg=cfg, stage=c.stage,
                                      loss_chunk=c.loss_chunk),
                    in_shardings=(state_sh.params, batch_sh))
  schedule = step_lib.make_schedule(c)
  start = int(jax.device_get(state.step))
  writer = metrics_lib.MetricWriter(workdir, tensorboard=c.tensorboard,
                                    resume_step=start if latest is not None else -1)
  progress = metrics_lib.Progress(start, c.total_steps, c.batch_size * c.seq_len)
  flops_tok = flops.flops_per_token(cfg, c.seq_len, c.stage)
  pending, last = [], {}
  data_stats = {}
  if _data_module(c) is sft:        # conversations longer than seq_len never enter a row
    data_stats = {"sft_dropped_conversations": sft.dropped(c.data.dir, "train", c.seq_len)}
    if data_stats["sft_dropped_conversations"]:
      logging.warning("sft: %d training conversations are longer than seq_len=%d and are "
                      "dropped", data_stats["sft_dropped_conversations"], c.seq_len)

  def flush(step):
    nonlocal pending, last
    rows = []
    for s, m in jax.device_get(pending):
      m = {k: float(v) for k, v in m.items()}
      if not all(np.isfinite(v) for v in m.values()):
        mngr.wait_until_finished()
        raise FloatingPointError(
            f"non-finite loss or gradient at step {s} ({m}); stopping. The last good "
            f"checkpoint ({mngr.latest_step()}) in {workdir} is intact.")
      m["learning_rate"] = float(schedule(s - 1))
      m.update(data_stats)
      rows.append((s, m))
    pending = []
    if rows:
      p = progress.update(step)
      rows[-1][1].update(p, est_mfu=flops.mfu(p["tokens_per_s"], flops_tok,
                                                mesh.size, c.peak_tflops))
      for s, m in rows:
        writer.write(s, m)
      last = dict(rows[-1][1])
      metrics_lib.log_line(c.stage, step, c.total_steps, last, p)
    writer.flush()

  def eval_and_write(step):
    try:
      ev = evaluate(c, cfg, state.params, eval_fn, meta, batch_sh)
    except Exception as e:  # pylint: disable=broad-except
      raise RuntimeError(
          f"held-out evaluation at step {step} failed (config.data.dir={c.data.dir!r}, "
          f"validation split): {type(e).__name__}: {e}; the checkpoint of step {step} in "
          f"{workdir} is saved") from e
    writer.write(step, ev, prefix="eval_")
    writer.flush()
    logging.info("[%s] step %d eval loss %.4f  bits/byte %.4f  indexer_kl %.4g", c.stage,
                 step, ev["loss"], ev.get("bits_per_byte", math.nan), ev["indexer_kl"])
    last.update({f"eval_{k}": v for k, v in ev.items()})

  eval_due = lambda step: step % c.eval_every == 0 or step == c.total_steps
  tracing, stop = False, False
  try:
    step = start
    # The mesh is set while steps trace: the MoE layers read its `expert` axis
    # to dispatch tokens with an all-to-all (nn/moe_ep.py).
    with jax.set_mesh(mesh):
      # A run stopped between a checkpoint and its evaluation evaluates first.
      if start > 0 and eval_due(start) and _agree(
          not metrics_lib.has_metric(workdir, start, "eval_loss")):
        eval_and_write(start)
      while step < c.total_steps:
        tracing = _profile(c, workdir, step, tracing)
        batch = _to_global(next(data_iter), batch_sh)
        state, m = train_fn(state, batch)
        step += 1
        pending.append((step, m))
        stop = preempt.should_stop(step)
        save = step % c.checkpoint_every == 0 or step == c.total_steps or stop
        if step % c.log_every == 0 or save:
          flush(step)                                   # also the non-finite check
        if save:                                        # before evaluating: an evaluation
          with _Timed(progress, state):                 # failure loses no training
            ckpt_lib.save(mngr, step, state, data_iter, force=True)
        if stop:
          break
        if eval_due(step):
          with _Timed(progress, state):
            eval_and_write(step)
      tracing = _profile(c, workdir, step, tracing)
    mngr.wait_until_finished()
  finally:
    if tracing:
      jax.profiler.stop_trace()
    writer.close()
    mngr.close()
  if stop:
    raise preemption.Preempted(step, workdir)
  if start == c.total_steps:                            # finished earlier: read back
    return {**metrics_lib.final_metrics(workdir), **last}
  return last
