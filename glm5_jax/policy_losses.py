"""RL policy losses: GRPO with IcePop, direct double-sided IS, TIS, CISPO, OPD advantages.

GLM-5 (arXiv 2602.15763, §3) trains reasoning RL with GRPO + IcePop (the train / inference
mismatch ratio of the sampled token gates the GRPO-clip surrogate) and asynchronous agentic RL
with direct double-sided importance sampling against the rollout log-probs (no recomputed old
policy); cross-stage on-policy distillation uses the teacher's log-probs as a per-token
advantage. TIS (Yao et al. 2025) and CISPO (MiniMax-M1, arXiv 2506.13585) are the usual
alternatives, kept for ablations. The formulas follow slime (`slime/utils/ppo_utils.py`,
`slime/backends/megatron_utils/loss.py`) and verl (`verl/trainer/ppo/core_algos.py`).

Notation: b sequences, t token positions. Per-token inputs are [b, t]:
  logp          log pi_theta(y_t), the policy being trained (the only input with a gradient).
  old_logp      log pi_old(y_t), the trainer's recompute under the step's starting weights.
  rollout_logp  log pi_roll(y_t), reported by the inference engine that sampled y_t.
  mask          > 0 on response tokens that carry loss (used as 0/1).
`advantages` is [b] (one per sequence) or [b, t] (per token). Entries outside the mask are
never read: even inf or NaN there adds exactly zero to the loss and to its gradient.

Conventions:
  * Every ratio is exp of a log-prob difference clamped to [-20, 20] (verl `core_algos.py`,
    tunix `rl/`), so an extreme log-ratio gives a finite value and gradient under jit.
  * Denominators count mask tokens before the IcePop / IS band drops any (slime `loss.py`
    keeps the pre-mask count, AReaL `ppo_actor_loss_fn` explains why): a dropped token lowers
    the loss, it does not up-weight the tokens that stay.
  * IcePop and TIS keep GRPO's aggregation (mean over each sequence's tokens, then over the
    sequences that have any); direct IS and CISPO take one token mean over the batch (GLM-5 §3,
    MiniMax-M1 eq. 4).
  * eps is a distance from 1: PPO clip and IS bands are [1 - eps_low, 1 + eps_high] (the slime
    and verl convention; ms-swift's CISPO instead reads eps_high as an absolute cap).

Metrics (scalars without gradient, over mask tokens, 0 when the batch has none):
  ratio_min, ratio_mean, ratio_max
                      r = pi_theta / pi_old (pi_theta / pi_roll for direct IS).
  clip_frac           IcePop, TIS: the PPO clip is active (clip(r) A < r A); CISPO: the weight
                      was truncated (clip(r) != r).
  icepop_masked_frac  IcePop: rho = pi_old / pi_roll outside [1/beta, beta].
  is_masked_frac      direct IS: r outside the band.
  tis_trunc_frac      TIS: rho above the cap.
  mismatch_kl         k3 estimate of KL(pi_roll || pi_train) on the sampled tokens:
                      x = log pi_roll - log pi_train, k3 = exp(-x) - 1 + x >= 0, unbiased
                      because y_t ~ pi_roll (slime `compute_approx_kl`). pi_train is pi_old
                      (IcePop, TIS) or pi_theta (direct IS).
  tokens, seqs        sum of the mask; sequences with at least one mask token.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0

# Hyper-parameter -> (valid?, what is allowed). Checked only for Python numbers (not tracers).
_HPARAMS = {
    "beta": (lambda v: v >= 1.0, ">= 1 (the IcePop band is [1/beta, beta])"),
    "eps_low": (lambda v: v >= 0.0, ">= 0 (the lower bound is 1 - eps_low)"),
    "eps_high": (lambda v: v >= 0.0, ">= 0 (the upper bound is 1 + eps_high)"),
    "cap": (lambda v: v > 0.0, "> 0 (the TIS weight is min(rho, cap))"),
    "eps": (lambda v: v >= 0.0, ">= 0"),
}


# --------------------------------------------------------------------------------------
# Inputs and reductions
# --------------------------------------------------------------------------------------

def check_hparams(**values):
  for name, value in values.items():
    ok, allowed = _HPARAMS[name]
    if isinstance(value, numbers.Real) and not ok(value):
      raise ValueError(f"{name}={value!r}: expected {allowed}")


def _float_array(name, x):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name}: dtype {x.dtype}; expected a floating-point array of log-probs")
  return x


def _token_inputs(advantages, mask, **logps):
  """Validated inputs as [b, t] arrays, zeroed outside the mask.

  `logps` are named [b, t] log-prob arrays, the first being `logp`. Returns (m_bt, a_bt,
  logps) in float32 or wider; the zeroing (`where`, not a product) keeps inf / NaN on padding
  out of both the values and the gradients.
  """
  names = list(logps)
  logp = _float_array(names[0], logps[names[0]])
  if logp.ndim != 2:
    raise ValueError(f"{names[0]}: shape {logp.shape}; expected [batch, time]")
  shape = logp.shape
  arrays = {names[0]: logp}
  for name in names[1:]:
    arrays[name] = _float_array(name, logps[name])
    if arrays[name].shape != shape:
      raise ValueError(f"{name}: shape {arrays[name].shape}; expected {shape} like {names[0]}")
  mask = jnp.asarray(mask)
  if mask.shape != shape:
    raise ValueError(f"mask: shape {mask.shape}; expected {shape} like {names[0]}")
  advantages = jnp.asarray(advantages)
  if advantages.shape not in (shape[:1], shape):
    raise ValueError(f"advantages: shape {advantages.shape}; expected [batch] {shape[:1]} or "
                     f"[batch, time] {shape}")
  dtype = jnp.promote_types(logp.dtype, jnp.float32)
  valid = mask > 0
  if advantages.ndim == 1:
    advantages = advantages[:, None]
  a = jnp.where(valid, jnp.broadcast_to(advantages, shape).astype(dtype), 0.0)
  out = {name: jnp.where(valid, x.astype(dtype), 0.0) for name, x in arrays.items()}
  # Gradient isolation: advantages are constants of the objective (an OPD advantage built
  # from logp must not be differentiated through).
  return valid.astype(dtype), jax.lax.stop_gradient(a), out


def _log_ratio(logp_a, logp_b):
  return jnp.clip(logp_a - logp_b, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def token_mean(x_bt, m_bt, num_tokens=None):
  """sum(x * m) / sum(m); 0 when the mask is empty. `num_tokens`: the denominator instead
  of sum(m) (a part of a larger batch: its share of the whole batch's mean)."""
  n = jnp.sum(m_bt) if num_tokens is None else num_tokens
  return jnp.sum(x_bt * m_bt) / jnp.maximum(n, 1.0)


def _sequence_mean(x_bt, m_bt, num_seqs=None):
  """Mean over each sequence's mask tokens, then over the sequences that have any (or over
  `num_seqs`: a part of a larger batch)."""
  n_b = jnp.sum(m_bt, axis=-1)
  per_seq = jnp.sum(x_bt * m_bt, axis=-1) / jnp.maximum(n_b, 1.0)
  n = jnp.sum(n_b > 0) if num_seqs is None else num_seqs
  return jnp.sum(per_seq) / jnp.maximum(n, 1)


def _base_metrics(r_bt, m_bt):
  """Ratio statistics and token / sequence counts over the mask."""
  has = jnp.sum(m_bt) > 0
  on = m_bt > 0
  return {
      "ratio_min": jnp.where(has, jnp.min(jnp.where(on, r_bt, jnp.inf)), 0.0),
      "ratio_mean": token_mean(r_bt, m_bt),
      "ratio_max": jnp.where(has, jnp.max(jnp.where(on, r_bt, -jnp.inf)), 0.0),
      "tokens": jnp.sum(m_bt),
      "seqs": jnp.sum(jnp.sum(m_bt, axis=-1) > 0).astype(m_bt.dtype),
  }


def _k3(x):
  """k3 = exp(-x) - 1 + x, x = log pi_roll - log pi_train (>= 0; slime `compute_approx_kl`)."""
  return jnp.exp(-x) - 1.0 + x


def _clipped_surrogate(r_bt, a_bt, eps_low, eps_high):
  """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) and where the clip is active."""
  unclipped = r_bt * a_bt
  clipped = jnp.clip(r_bt, 1.0 - eps_low, 1.0 + eps_high) * a_bt
  return jnp.minimum(unclipped, clipped), clipped < unclipped


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------

def group_advantages(rewards, *, normalize_std=False, eps=1e-6, valid=None):
  """GRPO advantages: each reward minus its group's mean (GLM-5 §3; DeepSeekMath §4.1).

  Args:
    rewards: [groups, G] rewards of the G samples drawn for each prompt.
    normalize_std: also divide by the group's std + eps. The std is the sample std
      (divisor G - 1), as torch's default `std` in slime (`rollout.py`
      `_post_process_rewards`) and verl (`compute_grpo_outcome_advantage`), so normalized
      advantages match theirs; a group of one gets 0 (its centred reward is 0).
    eps: added to the std.
    valid: optional [groups, G] 0/1 mask of samples whose reward counts (e.g. not an
      environment failure): the mean and std are over the valid samples of each group, and
      invalid samples get advantage 0.

  Returns:
    [groups, G] advantages in float32 (or the rewards' wider float type).
  """
  check_hparams(eps=eps)
  rewards = jnp.asarray(rewards)
  if rewards.ndim != 2:
    raise ValueError(f"rewards: shape {rewards.shape}; expected [groups, group_size]")
  dtype = jnp.promote_types(rewards.dtype, jnp.float32)
  r = rewards.astype(dtype)
  v = jnp.ones_like(r) if valid is None else (jnp.asarray(valid) > 0).astype(dtype)
  if v.shape != r.shape:
    raise ValueError(f"valid: shape {v.shape}; expected the rewards' {r.shape}")
  n = jnp.sum(v, axis=-1, keepdims=True)
  centred = v * (r - jnp.sum(v * r, axis=-1, keepdims=True) / jnp.maximum(n, 1.0))
  if not normalize_std:
    return centred
  std = jnp.sqrt(jnp.sum(centred ** 2, axis=-1, keepdims=True) / jnp.maximum(n - 1, 1.0))
  return centred / (std + eps)


def opd_advantages(teacher_logp, logp):
  """On-policy distillation advantage sg[log pi_teacher(y_t) - log pi_train(y_t)] (GLM-5 §3).

  Args:
    teacher_logp: [b, t] teacher log-probs of the sampled tokens (scored at the rollout's
      temperature).
    logp: [b, t] the student's log-probs of the same tokens.

  Returns:
    [b, t] per-token advantages, usable alone or added to a task advantage.
  """
  teacher_logp = _float_array("teacher_logp", teacher_logp)
  logp = _float_array("logp", logp)
  if teacher_logp.shape != logp.shape:
    raise ValueError(f"teacher_logp: shape {teacher_logp.shape}; expected {logp.shape} like logp")
  # Gradient isolation: the advantage is a fixed reward signal, not a loss on logp.
  return jax.lax.stop_gradient(teacher_logp - logp)


# --------------------------------------------------------------------------------------
# GRPO-clip weighted by the train / inference mismatch (IcePop, TIS)
# --------------------------------------------------------------------------------------

def _mismatch_weighted_grpo(weight_fn, flag_name, logp, old_logp, rollout_logp, advantages,
                            mask, eps_low, eps_high, num_seqs=None):
  """-seq_mean( w(rho) * min(r A, clip(r) A) ), rho = pi_old / pi_roll, r = pi_theta / pi_old.

  `weight_fn(rho_bt) -> (w_bt, flagged_bt)`; the flagged fraction is reported as `flag_name`.
  """
  m, a, lp = _token_inputs(advantages, mask, logp=logp, old_logp=old_logp,
                           rollout_logp=rollout_logp)
  # Gradient isolation: pi_old and pi_roll are fixed; only pi_theta (through r) is trained.
  old = jax.lax.stop_gradient(lp["old_logp"])
  roll = jax.lax.stop_gradient(lp["rollout_logp"])
  log_rho = _log_ratio(old, roll)
  w, flagged = weight_fn(jnp.exp(log_rho))
  r = jnp.exp(_log_ratio(lp["logp"], old))
  surrogate, clipped = _clipped_surrogate(r, a, eps_low, eps_high)
  loss = -_sequence_mean(w * surrogate, m, num_seqs)
  metrics = {**_base_metrics(r, m), "clip_frac": token_mean(clipped.astype(m.dtype), m),
             flag_name: token_mean(flagged.astype(m.dtype), m),
             "mismatch_kl": token_mean(_k3(-log_rho), m)}
  return loss, jax.lax.stop_gradient(metrics)


def icepop_grpo_loss(logp, old_logp, rollout_logp, advantages, mask, *, beta=2.0, eps_low=0.2,
                     eps_high=0.28, num_seqs=None):
  """GLM-5's reasoning-RL objective, GRPO with IcePop (GLM-5 §3; Ring-1T's IcePop), negated.

  Steps, per mask token:
    1. rho = exp(old_logp - rollout_logp): the trainer's vs the inference engine's probability
       of the sampled token under the same (old) weights.
    2. pop(rho) = rho if 1/beta <= rho <= beta else 0 (slime `icepop_function`).
    3. r = exp(logp - old_logp).
    4. term = pop(rho) * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).
  loss = -mean over sequences (with any mask token) of the mean of `term` over the sequence's
  mask tokens (popped tokens stay in that count).

  Args:
    logp, old_logp, rollout_logp: [b, t] log-probs (module docstring); only logp has a gradient.
    advantages: [b] or [b, t].
    mask: [b, t], > 0 on loss tokens.
    beta: IcePop band [1/beta, beta]; GLM-5 uses 2.
    eps_low, eps_high: the PPO clip range [1 - eps_low, 1 + eps_high]; GLM-5 uses 0.2, 0.28.
    num_seqs: the sequence count of the whole batch when this is one part of it (gradient
      accumulation): the parts' losses then add up to the whole batch's. None: this batch's.

  Returns:
    (scalar loss, metrics dict: ratio_*, clip_frac, icepop_masked_frac, mismatch_kl, tokens,
    seqs).
  """
  check_hparams(beta=beta, eps_low=eps_low, eps_high=eps_high)

  def pop(rho):
    keep = (rho >= 1.0 / beta) & (rho <= beta)
    return jnp.where(keep, rho, 0.0), ~keep

  return _mismatch_weighted_grpo(pop, "icepop_masked_frac", logp, old_logp, rollout_logp,
                                 advantages, mask, eps_low, eps_high, num_seqs)


def grpo_clip_loss(logp, old_logp, rollout_logp, advantages, mask, *, eps_low=0.2,
                   eps_high=0.28, num_seqs=None):
  """GRPO-clip without any train / inference mismatch correction, negated: the ablation of
  `icepop_grpo_loss` (pop(rho) = 1 for every token; the rollout log-probs enter only the
  metrics). `icepop_masked_frac` is 0: nothing is masked.

  Returns:
    (scalar loss, metrics dict as `icepop_grpo_loss`'s).
  """
  check_hparams(eps_low=eps_low, eps_high=eps_high)

  def keep_all(rho):
    return jnp.ones_like(rho), jnp.zeros(rho.shape, bool)

  return _mismatch_weighted_grpo(keep_all, "icepop_masked_frac", logp, old_logp, rollout_logp,
                                 advantages, mask, eps_low, eps_high, num_seqs)


def tis_grpo_loss(logp, old_logp, rollout_logp, advantages, mask, *, cap=2.0, eps_low=0.2,
                  eps_high=0.28):
  """GRPO-clip with truncated importance sampling (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"; slime `vanilla_tis_function`).

  As `icepop_grpo_loss`, with pop(rho) replaced by min(rho, cap): tokens with a large
  mismatch keep a capped weight instead of being dropped, and small rho is not cut at all.

  Returns:
    (scalar loss, metrics dict: ratio_*, clip_frac, tis_trunc_frac, mismatch_kl, tokens, seqs).
  """
  check_hparams(cap=cap, eps_low=eps_low, eps_high=eps_high)

  def truncate(rho):
    return jnp.minimum(rho, cap), rho > cap

  return _mismatch_weighted_grpo(truncate, "tis_trunc_frac", logp, old_logp, rollout_logp,
                                 advantages, mask, eps_low, eps_high)


# --------------------------------------------------------------------------------------
# REINFORCE with a stop-gradient IS weight (direct double-sided IS, CISPO)
# --------------------------------------------------------------------------------------

def double_sided_is_loss(logp, rollout_logp, advantages, mask, *, eps_low=0.2, eps_high=0.28,
                         num_tokens=None):
  """GLM-5's asynchronous agentic-RL objective: direct double-sided IS (GLM-5 §3), negated.

  Steps, per mask token:
    1. r = exp(logp - rollout_logp): current policy vs the engine that sampled the token
       (no recomputed old policy).
    2. f = sg(r) if 1 - eps_low < r < 1 + eps_high else 0, whatever the sign of A.
  loss = -sum(f A logp mask) / sum(mask). Since grad r = r grad logp, the gradient is that of
  -sum(1[band] r A mask) / sum(mask): REINFORCE with IS weights cut to zero outside a band.

  Args:
    logp, rollout_logp: [b, t] log-probs; only logp has a gradient.
    advantages: [b] or [b, t].
    mask: [b, t], > 0 on loss tokens (tokens outside the band stay in the denominator).
    eps_low, eps_high: the trust band (1 - eps_low, 1 + eps_high).
    num_tokens: the mask-token count of the whole batch when this is one part of it
      (gradient accumulation). None: this batch's.

  Returns:
    (scalar loss, metrics dict: ratio_*, is_masked_frac, mismatch_kl, tokens, seqs).
  """
  check_hparams(eps_low=eps_low, eps_high=eps_high)
  m, a, lp = _token_inputs(advantages, mask, logp=logp, rollout_logp=rollout_logp)
  logp = lp["logp"]
  log_r = jax.lax.stop_gradient(_log_ratio(logp, lp["rollout_logp"]))
  # Gradient isolation: f(r) is a constant weight; the gradient flows through logp only.
  r = jnp.exp(log_r)
  keep = (r > 1.0 - eps_low) & (r < 1.0 + eps_high)
  f = jnp.where(keep, r, 0.0)
  loss = -token_mean(f * a * logp, m, num_tokens)
  metrics = {**_base_metrics(r, m), "is_masked_frac": token_mean((~keep).astype(m.dtype), m),
             "mismatch_kl": token_mean(_k3(-log_r), m)}
  return loss, jax.lax.stop_gradient(metrics)


def cispo_loss(logp, old_logp, advantages, mask, *, eps_low=1.0, eps_high=0.28):
  """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5; slime `compute_cispo_loss`), negated.

  loss = -sum(sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp mask) / sum(mask), with
  r = exp(logp - old_logp). Unlike PPO, a token whose ratio is clipped keeps its gradient,
  scaled by the clipped weight.

  Args:
    logp, old_logp: [b, t] log-probs; only logp has a gradient.
    advantages: [b] or [b, t].
    mask: [b, t], > 0 on loss tokens.
    eps_low, eps_high: distances from 1 (slime / verl convention, not an absolute cap).
      The default eps_low = 1 puts the lower bound at 0, i.e. none, as MiniMax-M1 does;
      eps_high is the one bound the paper tunes (0.28 here, GLM-5's PPO upper clip).

  Returns:
    (scalar loss, metrics dict: ratio_*, clip_frac, tokens, seqs).
  """
  check_hparams(eps_low=eps_low, eps_high=eps_high)
  m, a, lp = _token_inputs(advantages, mask, logp=logp, old_logp=old_logp)
  logp = lp["logp"]
  # Gradient isolation: the clipped IS weight is a constant; the gradient flows through logp.
  r = jax.lax.stop_gradient(jnp.exp(_log_ratio(logp, lp["old_logp"])))
  w = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high)
  loss = -token_mean(w * a * logp, m)
  metrics = {**_base_metrics(r, m), "clip_frac": token_mean((w != r).astype(m.dtype), m)}
  return loss, jax.lax.stop_gradient(metrics)
