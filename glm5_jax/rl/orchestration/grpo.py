"""Synchronous GRPO with IcePop: GLM-5's reasoning-RL stage, a batch source of the runner.

`run(config, workdir)` = `train.loop.run(config, workdir, GRPO(config))`: the runner owns the
mesh, the state, the update, checkpoints, metrics and preemption (glm5_jax/train/loop.py);
`GRPO` owns sampling, rewards, groups and the consistency measurement. Each step (GLM-5
paper §3; the loop of slime's `train.py`):
  1. prompts   `rl.prompts_per_step` training problems of `rl.task`, drawn with a seed
               derived from (seed, step): the prompt cursor is the step
  2. rollout   `rl.group_size` samples per prompt from the engine, which runs the weights
               of version = step (in `rl.rollout_weight_dtype`: float32, or a deliberate
               low-precision gap, inference/precision.py): raw log-probs, every layer's DSA
               top-k and every MoE layer's routed experts recorded
  3. rewards   the task's reward function (`rewards.get`); A = r - mean of its group
  4. recompute log pi_train(theta_old) of every token with the trainer's forward; the
               train/rollout log-prob |diff|, DSA top-k and MoE routing mismatches are
               measured here. With `rl.routing_replay` (R3) the trainer's MoE layers use
               the engine's recorded experts, here and in the update
  5. update    the batch in `rl.minibatches` (>= 2) shuffled minibatches, one Muon Split step
               each on `icepop_grpo_loss` (the runner's `train_step`, stage row "rl"; after
               the first, pi_theta != pi_old and the clip acts); the indexer is frozen, the
               routing bias held
  6. publish   the engine gets the new params (same shapes and placement: no recompile)

Placement: colocated. The trainer's mesh (`config.mesh`, `config.num_devices`: fsdp, tensor,
expert, context as pretraining's) also serves the rollouts: the engine runs in the model's
shardings on the same devices and serves the trainer's own arrays (no copy; a push is a
version bump); generation and training alternate. The recomputed log-probs run under the
same mesh and rules as the update.
With `distill.teacher`, on-policy distillation (GLM-5 §3): each token's advantage is
`distill.coef` * sg(log pi_teacher - log pi_train) plus, if `distill.task_advantage`, the
task's GRPO advantage.

A sample whose reward function failed (an exception, a sandbox that could not start) is
an environment failure, not a wrong answer: it gets no loss and does not count in its
group's mean. Sampling is at temperature 1: the losses' ratios compare raw-policy log-probs,
which are the sampling distribution's only then.

Held-out accuracy (greedy) at the start and every `eval_every` steps, of the policy at the
trainer's precision (a second engine when the rollouts run in another one). Checkpoints (orbax)
hold the TrainState; everything random derives from (seed, step), so a killed and restarted
run reproduces the uninterrupted run's metrics exactly on CPU (rows a killed run wrote after
its last checkpoint are replaced). SIGTERM checkpoints and stops (train/preemption.py:
`Preempted`, exit 0); the checkpoint of a step is saved before its evaluation.
"""

from __future__ import annotations

import time

from absl import logging
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import convert
from glm5_jax import policy
from glm5_jax import policy_losses as rl_losses
from glm5_jax import sharding as shd
from glm5_jax.data import chat
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import precision
from glm5_jax.rl.algorithm import trajectory as traj_lib
from glm5_jax.rl.algorithm.batches import device_batch
from glm5_jax.rl.algorithm.batches import has_moe
from glm5_jax.rl.algorithm.batches import padded_length
from glm5_jax.rl.algorithm.batches import take_rows
from glm5_jax.rl.algorithm.consistency import consistency_metrics
from glm5_jax.rl.algorithm.consistency import warn_without_batch_invariance
from glm5_jax.rl.algorithm.seeds import seed_of
from glm5_jax.rl.envs import rewards as rewards_lib
from glm5_jax.rl.envs import rollout as rollout_lib
from glm5_jax.rl.envs import tasks as tasks_lib
from glm5_jax.train import loop


class GRPO:
  """The synchronous GRPO loop's batch source (module docstring; `train.loop.Source`)."""

  name = "rl"
  eval_prefix, eval_key, eval_at_start = "heldout_", "accuracy", True
  blocking = True
  solo = False                     # colocated: every process trains and samples
  items: dict = {}
  tokens_per_step = seq_len = None
  log_fields = (("reward", "reward_mean", ".3f"), ("|dlogp| max", "logp_abs_diff_max", ".2e"),
                ("topk mism", "topk_mismatches", ".0f"),
                ("route mism", "routing_mismatch_rate", ".4f"),
                ("masked", "icepop_masked_frac", ".4f"),
                ("clip", "clip_frac", ".3f"), ("len", "response_len_mean", ".1f"),
                ("rollout s", "rollout_s", ".1f"), ("update s", "update_s", ".1f"))

  def __init__(self, c):
    self.c, r = c, c.rl
    self.checkpoint_every, self.eval_every = r.checkpoint_every, r.eval_every
    self.task, self.reward_fn = rewards_lib.task_and_reward(r)
    self.tok = chat.get_chat_tokenizer(c.data.tokenizer)
    self.engine = self.teacher = self.eval_engine = None

  def model_config(self):
    cfg = convert.model_config_of(self.c.init_from, "config.init_from")
    return cfg.replace(attention_type="sparse")

  def setup(self, cfg, mesh, param_sh) -> None:
    c, r = self.c, self.c.rl
    if self.tok.vocab_size > cfg.vocab_size:
      raise ValueError(f"config.data.tokenizer={c.data.tokenizer!r} has {self.tok.vocab_size} "
                       f"ids > the model's vocab_size={cfg.vocab_size}")
    n, n_bat = r.group_size * r.prompts_per_step, shd.batch_axis_size(mesh)
    if (n // r.minibatches) % n_bat:
      raise ValueError(f"config.rl.minibatches={r.minibatches}: a minibatch of "
                       f"{n // r.minibatches} rollouts does not divide over the mesh's batch "
                       f"axes data*fsdp*expert={n_bat}")
    self.heldout = tasks_lib.heldout_problems(self.task, r, c.seed)
    sample = self.heldout + self.task.problems("train", r.prompts_per_step, seed_of(c.seed, 0, 1))
    tasks_lib.check_prompts_fit(
        [len(rollout_lib.prompt_ids(self.task, p, self.tok, enable_thinking=r.enable_thinking))
         for p in sample], r, "held-out problems and the first step's")
    self.cfg, self.mesh, self.param_sh = cfg, mesh, param_sh
    self.context = mesh.shape["context"]
    self.sharded = mesh.size > 1
    self.batch_sh = shd.batch_sharding(mesh) if self.sharded else None
    self.forward = policy.jitted_forward(cfg, chunk_size=r.logprob_chunk, mesh=mesh,
                                         param_sh=param_sh, batch_sh=self.batch_sh)
    if c.distill.teacher:
      self.teacher = load_teacher(c.distill.teacher, cfg, param_sh, mesh,
                                  shd.rules_from_config(c.mesh_rules))
    warn_without_batch_invariance()

  def save_items(self) -> dict:
    return {}

  def restore_items(self) -> dict:
    return {}

  def load(self, restored) -> None:
    del restored

  def start(self, state, resumed: bool) -> None:
    """The engine, sized to one step's rollouts exactly (every engine step runs all
    max_batch slots), serving the state's params on the trainer's mesh."""
    del resumed
    r = self.c.rl
    make = lambda **kw: Engine(
        self.cfg, state.params, max_batch=r.group_size * r.prompts_per_step,
        max_len=r.max_len, prefill_chunk=r.prefill_chunk, steps_per_sync=r.steps_per_sync,
        version=int(state.step), mesh=self.mesh if self.sharded else None,
        rules=self.c.mesh_rules, **kw)
    try:
      self.engine = make(record_routing=has_moe(self.cfg), **precision.engine_kwargs(r))
      # Held-out accuracy at the trainer's precision: the same arrays, served as they are.
      self.eval_engine = (self.engine if r.rollout_weight_dtype == "float32"
                          and r.rollout_kv_dtype == "float32" else make())
    except ValueError as e:
      raise ValueError(f"config.rl (max_len / prefill_chunk / steps_per_sync / mesh / "
                       f"rollout_weight_dtype, rollout_kv_dtype, rollout_quant_*): {e}"
                       ) from None

  def prepare(self, state) -> list:
    del state
    return []

  def batches(self, state, step: int):
    """Steps 1-4 of the module docstring: the step's minibatches and its host metrics."""
    c, r = self.c, self.c.rl
    problems = self.task.problems("train", r.prompts_per_step, seed_of(c.seed, step, 1))
    sp = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                        stop_token_ids=chat.stop_ids(self.tok), seed=seed_of(c.seed, step, 2))
    trajs, stats = rollout_lib.rollout(self.engine, self.task, self.reward_fn, problems,
                                       self.tok, group_size=r.group_size, sampling=sp,
                                       version=step, enable_thinking=r.enable_thinking,
                                       record_routing=self.engine.record_routing)
    rewards = np.asarray([tr.reward for tr in trajs], np.float32)
    valid = np.asarray([tr.error is None for tr in trajs])
    if jax.process_count() > 1:    # process 0's rewards for all: a sandbox's time limit may
      rewards, valid = multihost_utils.broadcast_one_to_all((rewards, valid))   # end otherwise
    shape = (r.prompts_per_step, r.group_size)
    adv = np.asarray(rl_losses.group_advantages(
        jnp.asarray(rewards.reshape(shape)), normalize_std=r.normalize_std,
        valid=jnp.asarray(valid.reshape(shape)))).reshape(-1)
    use_task = self.teacher is None or c.distill.task_advantage
    length = padded_length(max(tr.length for tr in trajs), self.context)
    batch = traj_lib.make_batch(trajs, adv if use_task else np.zeros_like(adv), length=length)
    batch.loss_mask[~valid] = 0.0                  # environment failures carry no loss
    t0 = time.perf_counter()
    dev = device_batch(batch, self.batch_sh, replay=r.routing_replay)
    old_logp, ent, topk, routing = self.forward(state.params, dev)
    m = consistency_metrics(batch, old_logp, topk, trajs, routing)
    advantages = dev["advantages"]
    if self.teacher is not None:                   # on-policy distillation, per token
      own = {k: v for k, v in dev.items() if k != "routing"}    # the teacher routes itself
      opd = rl_losses.opd_advantages(self.forward(self.teacher, own)[0], old_logp)
      advantages = advantages[:, None] + c.distill.coef * opd
      m["opd_advantage_mean"] = float(rl_losses.token_mean(opd, dev["loss_mask"]))
    dev = {**dev, "old_logp": old_logp, "advantages": advantages}
    order = np.random.default_rng(seed_of(c.seed, step, 3)).permutation(len(trajs))
    minibatches = [take_rows(dev, idx, self.batch_sh) for idx in np.split(order, r.minibatches)]
    m.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
             train_accuracy=float(np.mean(rewards >= 1.0)), env_failures=float((~valid).sum()),
             entropy_old=float(rl_losses.token_mean(ent, dev["loss_mask"])),
             batch_tokens=float(batch.segment_ids.sum()),
             batch_length=float(batch.tokens.shape[1]),
             recompute_s=time.perf_counter() - t0, **stats)
    return minibatches, m

  def after(self, state, step: int, reset_optimizer):
    """6. publish: the engine serves the new params (the trainer's arrays themselves)."""
    del reset_optimizer
    self.engine.update_params(state.params, version=step)
    if self.eval_engine is not self.engine:
      self.eval_engine.update_params(state.params, version=step)
    return state, {}

  def evaluate(self, state, step: int) -> dict:
    del state
    r = self.c.rl
    t0 = time.perf_counter()
    ev = rollout_lib.heldout_accuracy(self.eval_engine, self.task, self.reward_fn, self.heldout,
                                      self.tok, max_new_tokens=r.max_new_tokens,
                                      enable_thinking=r.enable_thinking)
    ev["eval_s"] = time.perf_counter() - t0
    logging.info("[rl] step %d held-out accuracy %.4f (%d problems, %.1fs)", step,
                 ev["accuracy"], ev["problems"], ev["eval_s"])
    return ev

  def close(self) -> None:
    self.engine = self.eval_engine = None


def load_teacher(path: str, cfg, param_sh, mesh, rules):
  """The distillation teacher's params, sharded like the student's; it must be a checkpoint
  of the policy's model."""
  what = "config.distill.teacher"
  t_cfg = convert.model_config_of(path, what)
  diff = config_lib.model_diff(config_lib.model_fields(t_cfg), config_lib.model_fields(cfg))
  if diff:
    raise ValueError(f"{what}={path!r}: a teacher must be a checkpoint of the policy's model; "
                     f"its config differs (field: (teacher, policy)): {diff}")
  return convert.load_params(path, cfg, param_sh, mesh=mesh, rules=rules, what=what)


def run(c, workdir: str) -> dict:
  """Runs `c.total_steps` GRPO steps in `workdir` (resuming if it holds a checkpoint)."""
  if c.stage != "rl":
    raise ValueError(f"config.stage={c.stage!r}: synchronous GRPO runs stage 'rl' (the "
                     "indexer frozen, loss icepop_grpo)")
  loop.validate_config(c)
  return loop.run(c, workdir, GRPO(c))
