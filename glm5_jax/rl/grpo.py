"""Synchronous GRPO with IcePop: GLM-5's reasoning-RL stage on one process.

`run(config, workdir)`. Each step (GLM-5 paper §3; the loop of slime's `train.py`):
  1. prompts   `rl.prompts_per_step` training problems of `rl.task`, drawn with a seed
               derived from (seed, step): the prompt cursor is the step
  2. rollout   `rl.group_size` samples per prompt from the engine, which runs the weights
               of version = step: raw log-probs and every layer's DSA top-k recorded
  3. rewards   the task's reward function (`rewards.get`); A = r - mean of its group
  4. recompute log pi_train(theta_old) of every token with the trainer's forward; the
               train/rollout log-prob |diff| and top-k mismatches are measured here
  5. update    the batch in `rl.minibatches` (>= 2) shuffled minibatches, one Muon Split step
               each on `icepop_grpo_loss` (after the first, pi_theta != pi_old and the clip
               acts); the indexer is frozen, the routing bias held
  6. publish   the engine gets the new params (same shapes and placement: no recompile)
With `distill.teacher`, on-policy distillation (GLM-5 §3): each token's advantage is
`distill.coef` * sg(log pi_teacher - log pi_train) plus, if `distill.task_advantage`, the
task's GRPO advantage.

Held-out accuracy (greedy) at the start and every `eval_every` steps. Checkpoints (orbax)
hold params, optimizer state and step; everything random derives from (seed, step), so a
killed and restarted run reproduces the uninterrupted run's metrics exactly on CPU.
"""

from __future__ import annotations

import functools
import os
import time

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from glm5_jax import numerics
from glm5_jax.data import chat
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.rl import losses as rl_losses
from glm5_jax.rl import policy
from glm5_jax.rl import rewards as rewards_lib
from glm5_jax.rl import rollout as rollout_lib
from glm5_jax.rl import tasks as tasks_lib
from glm5_jax.rl import trajectory as traj_lib
from glm5_jax.train import checkpoint as ckpt_lib
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import step as step_lib


@flax.struct.dataclass
class RLState:
  step: jax.Array
  params: object
  opt_state: object


def _seed(*parts) -> int:
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] % 2**31)


def validate(c) -> None:
  r = c.rl
  for f in ("group_size", "prompts_per_step", "minibatches", "max_new_tokens", "eval_every",
            "checkpoint_every", "eval_problems"):
    if r[f] < 1:
      raise ValueError(f"config.rl.{f}={r[f]}: expected >= 1")
  if r.group_size < 2:
    raise ValueError(f"config.rl.group_size={r.group_size}: GRPO needs >= 2 samples per prompt")
  n = r.group_size * r.prompts_per_step
  if n % r.minibatches:
    raise ValueError(f"config.rl.minibatches={r.minibatches} does not divide the "
                     f"{n} rollouts per step (group_size * prompts_per_step)")
  if not c.init_from:
    raise ValueError("config.init_from: RL starts from a trained model (an SFT workdir, a "
                     "pretraining workdir or a Hugging Face directory)")


def load_policy(path: str, what: str):
  """(ModelConfig, params) of a workdir or HF directory, with the error naming `what`."""
  try:
    return ckpt_lib.load_model(path)
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"{what}={path!r}: {e}") from None


def check_same_shape(params_a, params_b, what: str) -> None:
  shape = lambda t: jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), t)
  sa, sb = shape(params_a), shape(params_b)
  if jax.tree.structure(sa) != jax.tree.structure(sb) or sa != sb:
    raise ValueError(f"{what}: its model has another shape than the policy's; a teacher "
                     "must be a checkpoint of the same model")


def make_fns(cfg, tx, r):
  """(recompute, update) jitted: recompute(params, batch) -> (logp, entropy, top-k);
  update(state, minibatch) -> (state, metrics)."""
  fwd = functools.partial(policy.policy_forward, cfg=cfg, chunk_size=r.logprob_chunk)

  @jax.jit
  def recompute(params, b):
    return fwd(params, b["tokens"], b["positions"], b["segment_ids"], return_topk=True)

  @jax.jit
  def teacher_logp(params, b):
    return fwd(params, b["tokens"], b["positions"], b["segment_ids"])[0]

  @jax.jit
  def update(state, mb):
    def loss_fn(p):
      logp, ent, _ = fwd(p, mb["tokens"], mb["positions"], mb["segment_ids"])
      loss, m = rl_losses.icepop_grpo_loss(
          logp, mb["old_logp"], mb["rollout_logp"], mb["advantages"], mb["loss_mask"],
          beta=r.icepop_beta, eps_low=r.eps_low, eps_high=r.eps_high)
      n = jnp.maximum(jnp.sum(mb["loss_mask"]), 1.0)
      return loss, {**m, "entropy": jnp.sum(ent * mb["loss_mask"]) / n}
    (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    m = {**m, "loss": loss, "grad_norm": optax.global_norm(grads),
         "update_norm": optax.global_norm(updates)}
    return RLState(state.step, params, opt_state), m

  return recompute, teacher_logp, update


def _device_batch(b: traj_lib.TrajectoryBatch, **extra):
  d = {k: jnp.asarray(v) for k, v in b._asdict().items()
       if k in ("tokens", "positions", "segment_ids", "loss_mask", "rollout_logp", "advantages")}
  return {**d, **{k: jnp.asarray(v) for k, v in extra.items()}}


def consistency_metrics(batch, old_logp, topk, trajs) -> dict:
  """Train/rollout log-prob |diff| on response tokens, mismatch KL and top-k mismatches."""
  mask = batch.loss_mask > 0
  diff = np.abs(np.asarray(old_logp) - batch.rollout_logp)[mask]
  x = (np.asarray(old_logp) - batch.rollout_logp)[mask].astype(np.float64)
  bad, total = policy.topk_mismatches(trajs, topk) if topk is not None else (0, 0)
  return {"logp_abs_diff_max": float(diff.max(initial=0.0)),
          "logp_abs_diff_mean": float(diff.mean()) if diff.size else 0.0,
          "mismatch_kl_k3": float(np.mean(np.exp(-x) - 1 + x)) if x.size else 0.0,
          "topk_mismatches": float(bad), "topk_positions": float(total)}


class _Checkpoints:
  """orbax manager of RLState (params, optimizer state, step)."""

  def __init__(self, workdir, keep):
    self.mngr = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_handlers={"state": ocp.StandardCheckpointHandler()})

  def save(self, step, state):
    self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)

  def restore(self, abstract_state):
    step = self.mngr.latest_step()
    if step is None:
      return None
    out = self.mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))
    return out["state"]

  def close(self):
    self.mngr.wait_until_finished()
    self.mngr.close()


def run(c, workdir: str) -> dict:
  """Runs `c.total_steps` GRPO steps in `workdir` (resuming if it holds a checkpoint)."""
  validate(c)
  ckpt_lib.quiet_orbax()
  if jax.default_backend() == "cpu" and not numerics.is_set():
    logging.warning("XLA:CPU without batch-invariant dots: the engine's and the trainer's "
                    "log-probs will differ in the last bits (glm5_jax/numerics.py)")
  r = c.rl
  task = tasks_lib.get(r.task, **dict(r.task_options))
  reward_fn = rewards_lib.get(r.reward or r.task)
  tok = chat.get_chat_tokenizer(c.data.tokenizer)
  cfg, params = load_policy(c.init_from, "config.init_from")
  cfg = cfg.replace(attention_type="sparse")
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"data.tokenizer={c.data.tokenizer!r} has {tok.vocab_size} ids > the "
                     f"model's vocab_size={cfg.vocab_size}")
  ckpt_lib.check_model_config(workdir, cfg)
  teacher = None
  if c.distill.teacher:
    _, teacher = load_policy(c.distill.teacher, "config.distill.teacher")
    check_same_shape(params, teacher, f"config.distill.teacher={c.distill.teacher!r}")

  tx = step_lib.make_optimizer(c)
  state = RLState(jnp.zeros((), jnp.int32), params, jax.jit(tx.init)(params))
  ckpts = _Checkpoints(workdir, c.keep_checkpoints)
  restored = ckpts.restore(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
  state = restored if restored is not None else state
  start = int(state.step)

  n_req = r.group_size * r.prompts_per_step
  # Every engine step runs all max_batch slots: size it to one step's rollouts exactly.
  engine = Engine(cfg, state.params, max_batch=n_req, max_len=r.max_len,
                  prefill_chunk=r.prefill_chunk, steps_per_sync=r.steps_per_sync)
  recompute, teacher_logp, update = make_fns(cfg, tx, r)
  stop = chat.stop_ids(tok)
  heldout = task.problems("heldout", r.eval_problems, c.seed)
  writer = metrics_lib.MetricWriter(workdir, tensorboard=c.tensorboard)
  last = {}

  def evaluate(step):
    t0 = time.perf_counter()
    ev = rollout_lib.heldout_accuracy(engine, task, reward_fn, heldout, tok,
                                      max_new_tokens=r.max_new_tokens,
                                      enable_thinking=r.enable_thinking)
    ev["eval_s"] = time.perf_counter() - t0
    writer.write(step, ev, prefix="heldout_")
    logging.info("[rl] step %d held-out accuracy %.4f (%d problems, %.1fs)", step,
                 ev["accuracy"], ev["problems"], ev["eval_s"])
    last.update({f"heldout_{k}": v for k, v in ev.items()})
    if step == 0:
      last.update({f"initial_heldout_{k}": v for k, v in ev.items()})
    return ev

  try:
    if start == 0:
      evaluate(0)
    for step in range(start, c.total_steps):
      m = rl_step(step, state, engine, task, reward_fn, tok, stop, r, c, recompute,
                  teacher_logp, update, teacher)
      state, m = m
      engine.params = state.params                                  # 6. publish
      writer.write(step + 1, m)
      last.update(m)
      if (step + 1) % c.log_every == 0 or step + 1 == c.total_steps:
        logging.info("[rl] step %d/%d  reward %.3f  |dlogp| max %.2e  topk mism %d  masked %.4f"
                     "  clip %.3f  len %.1f  (rollout %.1fs, update %.1fs)", step + 1,
                     c.total_steps, m["reward_mean"], m["logp_abs_diff_max"],
                     m["topk_mismatches"], m["icepop_masked_frac"], m["clip_frac"],
                     m["response_len_mean"], m["rollout_s"], m["update_s"])
      if (step + 1) % r.eval_every == 0 or step + 1 == c.total_steps:
        evaluate(step + 1)
      if (step + 1) % r.checkpoint_every == 0 or step + 1 == c.total_steps:
        ckpts.save(step + 1, state)
      writer.flush()
  finally:
    ckpts.close()
    writer.close()
  return last


def rl_step(step, state, engine, task, reward_fn, tok, stop, r, c, recompute, teacher_logp,
            update, teacher):
  """One GRPO step (module docstring, steps 1-5). Returns (new state, metrics)."""
  problems = task.problems("train", r.prompts_per_step, _seed(c.seed, step, 1))
  sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                      stop_token_ids=stop, seed=_seed(c.seed, step, 2))
  trajs, stats = rollout_lib.rollout(engine, task, reward_fn, problems, tok,
                                     group_size=r.group_size, sampling=sp, version=step,
                                     enable_thinking=r.enable_thinking)
  rewards = np.asarray([tr.reward for tr in trajs], np.float32)
  adv = np.asarray(rl_losses.group_advantages(
      jnp.asarray(rewards.reshape(r.prompts_per_step, r.group_size)),
      normalize_std=r.normalize_std)).reshape(-1)
  use_task = teacher is None or c.distill.task_advantage
  batch = traj_lib.make_batch(trajs, adv if use_task else np.zeros_like(adv))
  t0 = time.perf_counter()
  dev = _device_batch(batch)
  old_logp, ent, topk = recompute(state.params, dev)
  m = consistency_metrics(batch, old_logp, topk, trajs)
  advantages = dev["advantages"]
  if teacher is not None:                       # on-policy distillation, per token
    opd = rl_losses.opd_advantages(teacher_logp(teacher, dev), old_logp)
    advantages = advantages[:, None] + c.distill.coef * opd
    m["opd_advantage_mean"] = float(jnp.sum(opd * dev["loss_mask"]) /
                                    jnp.maximum(jnp.sum(dev["loss_mask"]), 1.0))
  dev = {**dev, "old_logp": old_logp, "advantages": advantages}
  t1 = time.perf_counter()
  order = np.random.default_rng(_seed(c.seed, step, 3)).permutation(len(trajs))
  per_mb = []
  for idx in np.split(order, r.minibatches):
    mb = {k: v[jnp.asarray(idx)] for k, v in dev.items()}
    state, mm = update(state, mb)
    per_mb.append(mm)
  per_mb = jax.device_get(per_mb)
  t2 = time.perf_counter()
  state = RLState(state.step + 1, state.params, state.opt_state)
  mean = lambda k: float(np.mean([float(x[k]) for x in per_mb]))
  m.update({k: mean(k) for k in per_mb[0]})
  m.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
           train_accuracy=float(np.mean(rewards >= 1.0)),
           entropy_rollout=float(jnp.sum(ent * dev["loss_mask"]) /
                                 jnp.maximum(jnp.sum(dev["loss_mask"]), 1.0)),
           batch_tokens=float(batch.segment_ids.sum()), batch_length=float(batch.tokens.shape[1]),
           recompute_s=t1 - t0, update_s=t2 - t1, **stats)
  return state, m
