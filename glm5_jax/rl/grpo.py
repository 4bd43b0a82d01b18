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

A sample whose reward function failed (an exception, a sandbox that could not start) is
an environment failure, not a wrong answer: it gets no loss and does not count in its
group's mean. Sampling is at temperature 1: the losses' ratios compare raw-policy log-probs,
which are the sampling distribution's only then.

Held-out accuracy (greedy) at the start and every `eval_every` steps. Checkpoints (orbax)
hold params, optimizer state and step; everything random derives from (seed, step), so a
killed and restarted run reproduces the uninterrupted run's metrics exactly on CPU (rows a
killed run wrote after its last checkpoint are replaced). SIGTERM checkpoints and stops
(train/preemption.py: `Preempted`, exit 0); the checkpoint of a step is saved before its
evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
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
from glm5_jax.train import preemption
from glm5_jax.train import step as step_lib


@flax.struct.dataclass
class RLState:
  step: jax.Array
  params: object
  opt_state: object


def seed_of(*parts) -> int:
  """A 31-bit seed derived from integer parts (seed, step, purpose, ...)."""
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] % 2**31)


def validate(c) -> None:
  """Clear errors, naming the config field, before anything is built."""
  r = c.rl
  if c.stage != "rl":
    raise ValueError(f"config.stage={c.stage!r}: RL runs stage 'rl' (the indexer frozen)")
  for f in ("group_size", "prompts_per_step", "minibatches", "max_new_tokens", "eval_every",
            "checkpoint_every", "eval_problems", "max_len", "prefill_chunk", "steps_per_sync",
            "logprob_chunk"):
    if r[f] < 1:
      raise ValueError(f"config.rl.{f}={r[f]}: expected >= 1")
  ckpt_lib.check_run_fields(c, ("log_every", "total_steps"))
  if r.group_size < 2:
    raise ValueError(f"config.rl.group_size={r.group_size}: GRPO needs >= 2 samples per prompt")
  n = r.group_size * r.prompts_per_step
  if r.minibatches < 2 or n % r.minibatches:
    raise ValueError(f"config.rl.minibatches={r.minibatches}: expected >= 2 (so the clip acts) "
                     f"and a divisor of the {n} rollouts per step (group_size * prompts_per_step)")
  if r.temperature != 1.0:
    raise ValueError(f"config.rl.temperature={r.temperature}: expected 1.0; the losses compare "
                     "raw-policy log-probs, which are the sampling distribution's only at 1")
  for name, value in (("icepop_beta", r.icepop_beta), ("eps_low", r.eps_low),
                      ("eps_high", r.eps_high)):
    try:
      rl_losses.check_hparams(**{"beta" if name == "icepop_beta" else name: value})
    except ValueError as e:
      raise ValueError(f"config.rl.{name}: {e}") from None
  if not c.init_from:
    raise ValueError("config.init_from: RL starts from a trained model (an SFT workdir, a "
                     "pretraining workdir or a Hugging Face directory)")


def load_policy(path: str, what: str):
  """(ModelConfig, params) of a workdir or HF directory, with the error naming `what`."""
  try:
    return ckpt_lib.load_model(path)
  except (FileNotFoundError, ValueError) as e:
    raise ValueError(f"{what}={path!r}: {e}") from None


def _task(r):
  try:
    task = tasks_lib.get(r.task, **dict(r.task_options))
  except ValueError as e:
    raise ValueError(f"config.rl.task={r.task!r} with config.rl.task_options="
                     f"{dict(r.task_options)} (filled for the config's default task; give the "
                     f"chosen task's options): {e}") from None
  try:
    reward_fn = rewards_lib.get(r.reward or r.task)
  except ValueError as e:
    raise ValueError(f"config.rl.reward={r.reward or r.task!r}: {e}") from None
  return task, reward_fn


def make_fns(cfg, tx, r):
  """Jitted (recompute, teacher_logp, update):
    recompute(params, batch) -> (logp [b, t], entropy [b, t], top-k [L] of [b, t, K])
    teacher_logp(params, batch) -> logp [b, t]
    update(state, minibatch) -> (state, metrics): one optimizer step on icepop_grpo_loss
  batch: the `TrajectoryBatch` fields as arrays (+ old_logp [b, t] for update; advantages
  [b] or, with OPD, [b, t])."""
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
      return loss, {**m, "entropy": rl_losses.token_mean(ent, mb["loss_mask"])}
    (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    m = {**m, "loss": loss, "grad_norm": optax.global_norm(grads),
         "update_norm": optax.global_norm(updates)}
    return RLState(state.step, params, opt_state), m

  return recompute, teacher_logp, update


@dataclasses.dataclass
class Setup:
  """What `run` builds once and every `rl_step` uses."""
  c: object
  cfg: object
  task: object
  reward_fn: object
  tok: object
  engine: Engine
  recompute: object
  teacher_logp: object
  update: object
  teacher: object = None


def build(c, cfg, params, *, teacher=None) -> tuple[Setup, RLState]:
  """The engine (sized to one step's rollouts), the jitted functions and a fresh state."""
  r = c.rl
  task, reward_fn = _task(r)
  tok = chat.get_chat_tokenizer(c.data.tokenizer)
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"config.data.tokenizer={c.data.tokenizer!r} has {tok.vocab_size} ids > "
                     f"the model's vocab_size={cfg.vocab_size}")
  tx = step_lib.make_optimizer(c)
  state = RLState(jnp.zeros((), jnp.int32), params, jax.jit(tx.init)(params))
  # Every engine step runs all max_batch slots: size it to one step's rollouts exactly.
  try:
    engine = Engine(cfg, params, max_batch=r.group_size * r.prompts_per_step,
                    max_len=r.max_len, prefill_chunk=r.prefill_chunk,
                    steps_per_sync=r.steps_per_sync)
  except ValueError as e:
    raise ValueError(f"config.rl (max_len / prefill_chunk / steps_per_sync): {e}") from None
  return Setup(c, cfg, task, reward_fn, tok, engine, *make_fns(cfg, tx, r), teacher), state


def consistency_metrics(batch, old_logp_bt, topk, trajs) -> dict:
  """Train/rollout agreement on the response tokens of `batch`: log-prob |diff| (max, mean),
  the k3 mismatch KL (rollout || train) and the positions where some layer's top-k differs.
  old_logp_bt: the trainer's log-probs [b, t]; topk: its per-layer top-k [L] of [b, t, K]."""
  mask = batch.loss_mask > 0
  x = (batch.rollout_logp - np.asarray(old_logp_bt, np.float64))[mask]
  bad, total = policy.topk_mismatches(trajs, topk) if topk is not None else (0, 0)
  return {"logp_abs_diff_max": float(np.abs(x).max(initial=0.0)),
          "logp_abs_diff_mean": float(np.abs(x).mean()) if x.size else 0.0,
          "mismatch_kl_k3": float(np.mean(np.exp(-x) - 1 + x)) if x.size else 0.0,
          "topk_mismatches": float(bad), "topk_positions": float(total)}


def device_batch(b: traj_lib.TrajectoryBatch) -> dict:
  """The fields of `b` a trainer step reads, as device arrays."""
  return {k: jnp.asarray(getattr(b, k)) for k in ("tokens", "positions", "segment_ids",
                                                  "loss_mask", "rollout_logp", "advantages")}


def rl_step(s: Setup, state: RLState, step: int):
  """One GRPO step (module docstring, steps 1-5). Returns (new state, metrics)."""
  c, r = s.c, s.c.rl
  problems = s.task.problems("train", r.prompts_per_step, seed_of(c.seed, step, 1))
  sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                      stop_token_ids=chat.stop_ids(s.tok), seed=seed_of(c.seed, step, 2))
  trajs, stats = rollout_lib.rollout(s.engine, s.task, s.reward_fn, problems, s.tok,
                                     group_size=r.group_size, sampling=sp, version=step,
                                     enable_thinking=r.enable_thinking)
  rewards = np.asarray([tr.reward for tr in trajs], np.float32)
  valid = np.asarray([tr.error is None for tr in trajs])
  shape = (r.prompts_per_step, r.group_size)
  adv = np.asarray(rl_losses.group_advantages(
      jnp.asarray(rewards.reshape(shape)), normalize_std=r.normalize_std,
      valid=jnp.asarray(valid.reshape(shape)))).reshape(-1)
  use_task = s.teacher is None or c.distill.task_advantage
  batch = traj_lib.make_batch(trajs, adv if use_task else np.zeros_like(adv))
  batch.loss_mask[~valid] = 0.0                  # environment failures carry no loss
  t0 = time.perf_counter()
  dev = device_batch(batch)
  old_logp, ent, topk = s.recompute(state.params, dev)
  m = consistency_metrics(batch, old_logp, topk, trajs)
  advantages = dev["advantages"]
  if s.teacher is not None:                      # on-policy distillation, per token
    opd = rl_losses.opd_advantages(s.teacher_logp(s.teacher, dev), old_logp)
    advantages = advantages[:, None] + c.distill.coef * opd
    m["opd_advantage_mean"] = float(rl_losses.token_mean(opd, dev["loss_mask"]))
  dev = {**dev, "old_logp": old_logp, "advantages": advantages}
  t1 = time.perf_counter()
  order = np.random.default_rng(seed_of(c.seed, step, 3)).permutation(len(trajs))
  per_mb = []
  for idx in np.split(order, r.minibatches):
    state, mm = s.update(state, {k: v[jnp.asarray(idx)] for k, v in dev.items()})
    per_mb.append(mm)
  per_mb = jax.device_get(per_mb)
  t2 = time.perf_counter()
  m.update({k: float(np.mean([float(x[k]) for x in per_mb])) for k in per_mb[0]})
  m.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
           train_accuracy=float(np.mean(rewards >= 1.0)), env_failures=float((~valid).sum()),
           entropy_old=float(rl_losses.token_mean(ent, dev["loss_mask"])),
           batch_tokens=float(batch.segment_ids.sum()), batch_length=float(batch.tokens.shape[1]),
           recompute_s=t1 - t0, update_s=t2 - t1, **stats)
  return RLState(state.step + 1, state.params, state.opt_state), m


class _Checkpoints:
  """orbax manager of RLState (params, optimizer state, step)."""

  def __init__(self, workdir, keep):
    self.mngr = ckpt_lib.state_manager(workdir, keep=keep)

  def save(self, step, state):
    self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)

  def restore(self, abstract_state, what: str):
    """The newest readable checkpoint's state (a corrupt one is skipped; see
    `checkpoint.restore_latest`), or None."""
    step, state = ckpt_lib.restore_latest(self.mngr, abstract_state, None, what=what)
    return state if step is not None else None

  def close(self):
    self.mngr.wait_until_finished()
    self.mngr.close()


def _load_teacher(c, cfg, params):
  if not c.distill.teacher:
    return None
  what = f"config.distill.teacher={c.distill.teacher!r}"
  t_cfg, teacher = load_policy(c.distill.teacher, "config.distill.teacher")
  diff = ckpt_lib.model_diff(ckpt_lib.model_fields(t_cfg), ckpt_lib.model_fields(cfg))
  shape = lambda t: jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), t)
  if diff or shape(teacher) != shape(params):
    raise ValueError(f"{what}: a teacher must be a checkpoint of the policy's model; "
                     f"its config differs (field: (teacher, policy)): {diff}")
  return teacher


def run(c, workdir: str) -> dict:
  """Runs `c.total_steps` GRPO steps in `workdir` (resuming if it holds a checkpoint)."""
  validate(c)
  ckpt_lib.quiet_orbax()
  if jax.default_backend() == "cpu" and not numerics.is_set():
    logging.warning("XLA:CPU without batch-invariant dots: the engine's and the trainer's "
                    "log-probs will differ in the last bits (glm5_jax/numerics.py)")
  cfg, params = load_policy(c.init_from, "config.init_from")
  cfg = cfg.replace(attention_type="sparse")
  teacher = _load_teacher(c, cfg, params)
  ckpt_lib.check_model_config(workdir, cfg)
  setup, state = build(c, cfg, params, teacher=teacher)
  r = c.rl
  try:
    heldout = setup.task.problems("heldout", r.eval_problems, c.seed)
  except ValueError as e:
    raise ValueError(f"config.rl.eval_problems={r.eval_problems}: {e}") from None
  ckpts = _Checkpoints(workdir, c.keep_checkpoints)
  preempt = preemption.Preemption()
  writer = None
  last = {}
  stop = False
  try:
    restored = ckpts.restore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state),
                             what=f"config.optimizer={c.optimizer!r} (stage 'rl')")
    state = restored if restored is not None else state
    start = int(state.step)
    if start > c.total_steps:
      raise ValueError(f"config.total_steps={c.total_steps} is below the step {start} of the "
                       f"checkpoint in {workdir}: expected >= {start}")
    setup.engine.update_params(state.params, version=start)
    writer = metrics_lib.MetricWriter(workdir, tensorboard=c.tensorboard,
                                      resume_step=start if restored is not None else -1)

    def evaluate(step):
      t0 = time.perf_counter()
      ev = rollout_lib.heldout_accuracy(setup.engine, setup.task, setup.reward_fn, heldout,
                                        setup.tok, max_new_tokens=r.max_new_tokens,
                                        enable_thinking=r.enable_thinking)
      ev["eval_s"] = time.perf_counter() - t0
      writer.write(step, ev, prefix="heldout_")
      logging.info("[rl] step %d held-out accuracy %.4f (%d problems, %.1fs)", step,
                   ev["accuracy"], ev["problems"], ev["eval_s"])
      last.update({f"heldout_{k}": v for k, v in ev.items()})

    eval_due = lambda step: step % r.eval_every == 0 or step == c.total_steps
    # From scratch, and after a run stopped between a checkpoint and its evaluation.
    if start == 0 or (eval_due(start)
                      and not metrics_lib.has_metric(workdir, start, "heldout_accuracy")):
      evaluate(start)
    for step in range(start, c.total_steps):
      state, m = rl_step(setup, state, step)
      setup.engine.update_params(state.params, version=step + 1)   # 6. publish
      writer.write(step + 1, m)
      last.update(m)
      done = step + 1 == c.total_steps
      stop = preempt.should_stop(step + 1)
      if (step + 1) % c.log_every == 0 or done or stop:
        logging.info("[rl] step %d/%d  reward %.3f  |dlogp| max %.2e  topk mism %d  masked %.4f"
                     "  clip %.3f  len %.1f  (rollout %.1fs, update %.1fs)", step + 1,
                     c.total_steps, m["reward_mean"], m["logp_abs_diff_max"],
                     m["topk_mismatches"], m["icepop_masked_frac"], m["clip_frac"],
                     m["response_len_mean"], m["rollout_s"], m["update_s"])
      if (step + 1) % r.checkpoint_every == 0 or done or stop:   # before evaluating: an
        ckpts.save(step + 1, state)                               # evaluation failure loses
      writer.flush()                                              # no training
      if stop:
        break
      if eval_due(step + 1):
        evaluate(step + 1)
  finally:
    preempt.close()
    ckpts.close()
    if writer is not None:
      writer.close()
  if stop:
    raise preemption.Preempted(int(state.step), workdir)
  if start == c.total_steps:                     # finished earlier: read back
    return {**metrics_lib.final_metrics(workdir), **last}
  return last
