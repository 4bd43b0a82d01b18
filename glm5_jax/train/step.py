"""Train and eval steps: losses per stage, optimizer update, routing-bias update.

What each stage does is one row of `STAGE_TABLE` (GLM-5 paper §2 "DSA" and §3):
  stage        attention  trains              loss             what it is
  pretrain     dense      all but indexer     lm               LM + MTP
  midtrain     dense      all but indexer     lm               LM + MTP (longer sequences)
  dsa_warmup   dense      indexer only        lm               dense indexer KL alone
                                                               (DeepSeek-V3.2 eq. 3)
  dsa_sparse   sparse     all                 lm               LM + MTP + sparse indexer KL
                                                               (eq. 4; detached inputs)
  sft          sparse     all                 lm               LM + MTP on the assistant's
                                                               tokens (loss_mask) + sparse
                                                               indexer KL (the indexer adapts
                                                               to the new data)
  rl           sparse     all but indexer     icepop_grpo      GRPO + IcePop on rollouts
                                                               (synchronous; with a teacher,
                                                               on-policy distillation: the
                                                               same loss, per-token advantages)
  rl_async     sparse     all but indexer     double_sided_is  direct double-sided IS against
                                                               the rollout log-probs
The indexer is frozen in RL, as slime's GLM-5 recipe does (`--freeze-indexer`), so the
trainer's and the rollout engine's top-k stay the same function of the same weights.

Every stage runs the one `train_step`: `LOSSES[row.loss]` gives the loss of a batch, then
the optimizer update (with gradient accumulation over `microbatches`), and the routing-bias
update where the LM loss runs the routed layers forward. A batch is a dict of [b, ...]
arrays: `tokens`, `positions`, `segment_ids` (+ `loss_mask`) for the LM loss; the RL losses
add `loss_mask`, `rollout_logp`, `advantages` ([b] or [b, t]) and, for IcePop, `old_logp`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from glm5_jax import losses
from glm5_jax import nn as gnn
from glm5_jax import optim
from glm5_jax import policy
from glm5_jax import policy_losses
from glm5_jax import quant
from glm5_jax.nn import context_parallel as cp
from glm5_jax.nn import layer_stack
from glm5_jax.optim.param_groups import matrix_mask
from glm5_jax.optim.param_groups import path_str
from glm5_jax.train.stages import STAGE_TABLE, STAGES, Stage, get_stage  # noqa: F401


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def stage_model_config(cfg, stage: str):
  """The ModelConfig a stage runs: dense or top-k sparse attention."""
  return cfg.replace(attention_type=get_stage(stage).attention)


_FROZEN = {"all": None, "all_but_indexer": lambda: optim.path_mask("indexer"),
           "indexer": lambda: optim.path_mask("indexer", invert=True)}


def frozen_mask(stage: str):
  """optax-style mask of parameters that must not change in `stage` (None: nothing frozen)."""
  make = _FROZEN[get_stage(stage).trains]
  return make() if make else None


def make_schedule(c, peak: float | None = None) -> optax.Schedule:
  """Linear warmup then cosine decay to `final_lr_fraction` of the peak."""
  peak = c.learning_rate if peak is None else peak
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=c.warmup_steps,
      decay_steps=max(c.total_steps, c.warmup_steps + 1), end_value=peak * c.final_lr_fraction)


def _muon(c, sched, frozen, shardings, **how):
  adam = make_schedule(c, c.adam_learning_rate) if c.adam_learning_rate else None
  return optim.muon_split(learning_rate=sched, adam_learning_rate=adam,
                          weight_decay=c.weight_decay, frozen=frozen,
                          distribution=muon_distribution(c), param_shardings=shardings, **how)


def _adamw(c, sched, frozen, shardings):
  """AdamW on every trained leaf, decoupled weight decay on matrices only (as Muon Split's
  AdamW group); frozen and fixed leaves get zero updates."""
  del shardings                                 # elementwise: nothing to distribute
  def labels(p):
    fr = frozen(p) if frozen else _false(p)
    return jax.tree.map(lambda a, b: "frozen" if (a or b) else "train", _fixed(p), fr)
  return optax.multi_transform(
      {"train": optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=c.weight_decay,
                            mask=matrix_mask),
       "frozen": optax.set_to_zero()}, labels)


# config.optimizer -> its builder (c, schedule, frozen mask, parameter shardings). The two
# Muon rows are the Muon Split ablation's (docs/muon_split_ablation.md): per-head
# Newton–Schulz on W^UQ/W^UK/W^UV with the scale of one head's block (GLM-5), or
# whole-matrix Muon on them with the whole matrix's scale; the other hidden matrices take
# Muon and the rest AdamW in both.
OPTIMIZERS = {
    "muon_split": functools.partial(_muon, split_heads=True, rms_shape="per_head"),
    "muon": functools.partial(_muon, split_heads=False, rms_shape="full"),
    "adamw": _adamw,
}


def check_optimizer(name) -> str:
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer={name!r}: expected one of {tuple(OPTIMIZERS)}")
  return name


def muon_distribution(c) -> str:
  """`config.muon_distribution` (absent: "owner"), checked."""
  name = c.get("muon_distribution", "owner")
  if name not in optim.DISTRIBUTIONS:
    raise ValueError(f"config.muon_distribution={name!r}: expected one of "
                     f"{optim.DISTRIBUTIONS}")
  return name


def make_optimizer(c, param_shardings=None) -> optax.GradientTransformation:
  """Gradient clipping, then `OPTIMIZERS[c.optimizer]` with the stage's frozen mask.

  param_shardings: the parameters' shardings under a mesh (a tree like params). With them,
  `config.muon_distribution="owner"` orthogonalizes each Muon block on one owner device
  (optim/muon_owner.py); without them, or with "replicated", Newton–Schulz runs on the
  sharded leaves as they are. The optimizer state is the same either way.
  """
  build = OPTIMIZERS[check_optimizer(c.optimizer)]
  muon_distribution(c)
  return optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     build(c, make_schedule(c), frozen_mask(c.stage), param_shardings))


def _fixed(p):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "e_score_correction_bias" in jax.tree_util.keystr(path), p)


def _false(p):
  return jax.tree.map(lambda _: False, p)


def targets(batch, offset: int):
  """Targets at `offset` and their mask: same document, not padding, and (SFT rows) a target
  token the assistant produced (`loss_mask`)."""
  return losses.next_token_targets(batch["tokens"], batch.get("loss_mask"), offset=offset,
                                   segment_ids=batch["segment_ids"])


def target_offsets(cfg, stage: str) -> list[int]:
  """Target offsets of a stage's losses: 1 (next token) and 2..D+1 (MTP steps)."""
  st, mcfg = get_stage(stage), stage_model_config(cfg, stage)
  return [1] + ([k + 2 for k in range(mcfg.mtp_num_steps)] if mcfg.has_mtp and st.lm_loss
                else [])


def loss_fn(params, batch, *, cfg, stage: str, loss_chunk: int, norm=None, qat=None):
  """Total loss and its parts for one batch {tokens, segment_ids, positions}.

  qat: a `quant.Scheme` (config.qat): the forward runs `quant.fake_quant` of the targeted
    weights (quantization-aware training: the INT4 weights the deployed model will serve,
    a straight-through gradient to the float32 master weights).

  norm: None, or this batch's share of a larger one (gradient accumulation,
    `train_step`): {"tokens": {offset: target tokens of the whole batch}, "parts": number
    of equal parts}. Each token-weighted mean is then this part's sum over the whole
    batch's count, and the row mean (indexer KL) is divided by the number of parts, so the
    parts' losses, gradients and parts["loss" | "ce" | "mtp" | "indexer_kl" | "tokens"]
    add up to the whole batch's.
  """
  st = get_stage(stage)
  mcfg = stage_model_config(cfg, stage)
  with_kl = st.indexer_kl
  # Targets at offset 1 (next token) and 2..D+1 (MTP steps), in natural order.
  offsets = target_offsets(cfg, stage)
  tgt = {o: targets(batch, o) for o in offsets}
  # A mean over this batch's n tokens, rescaled to a share of the whole batch's N.
  share = ((lambda o, n: 1.0) if norm is None
           else (lambda o, n: n / jnp.maximum(norm["tokens"][o], 1.0)))
  n_parts = 1 if norm is None else norm["parts"]
  inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
  order = None
  if cp.size() > 1:                      # context parallelism: zig-zag rows over `context`
    order = jnp.asarray(cp.zigzag_order(batch["tokens"].shape[1], cp.size()))
    inputs = tuple(cp.permute(x, order) for x in inputs)
    tgt = {o: tuple(cp.permute(x, order) for x in ym) for o, ym in tgt.items()}
  model_params = params if qat is None else quant.fake_quant_tree(params, qat)
  out = gnn.GLM5(mcfg).apply({"params": model_params}, *inputs, with_indexer_loss=with_kl,
                             return_logits=False, order=order)
  head = params["lm_head"]["kernel"]
  y, m = tgt[1]
  ce, n_tok = losses.chunked_cross_entropy(out.hidden, head, y, m, chunk_size=loss_chunk)
  ce = ce * share(1, n_tok)
  mtp_ce = []
  if out.mtp_hidden is not None and st.lm_loss:
    for k in range(mcfg.mtp_num_steps):
      yk, mk = tgt[k + 2]
      ce_k, n_k = losses.chunked_cross_entropy(out.mtp_hidden[k], head, yk, mk,
                                               chunk_size=loss_chunk)
      mtp_ce.append(ce_k * share(k + 2, n_k))
  mtp = losses.mtp_loss(mtp_ce, mcfg.mtp_loss_weight)
  kl = jnp.zeros(()) if out.indexer_kl is None else jnp.sum(out.indexer_kl)
  n_kl_layers = max(1, mcfg.num_hidden_layers)
  if out.mtp_indexer_kl is not None:            # the shared MTP layer's indexer, once
    kl = kl + jnp.mean(out.mtp_indexer_kl)
    n_kl_layers += 1
  kl = kl / n_parts                             # a mean over rows: equal parts
  if not st.lm_loss:
    total = kl                                    # only the indexer trains
  else:
    total = ce + mtp + mcfg.indexer_loss_coeff * kl
  load = out.expert_load
  parts = {"loss": total, "ce": ce, "mtp": mtp, "indexer_kl": kl / n_kl_layers,
           "tokens": n_tok,
           "expert_imbalance": expert_imbalance(load)}
  mtp_load = None if out.mtp_expert_load is None else jnp.mean(out.mtp_expert_load, axis=0)
  return total, (parts, (load, mtp_load))


def expert_imbalance(load):
  """max / mean of the expert load (1 = balanced); 0 without MoE layers."""
  if not load.size:
    return jnp.zeros(())
  return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)


# The RL rows' objectives (GLM-5 §3; glm5_jax/policy_losses.py) on a batch with the policy's
# log-probs `logp` [b, t], and the whole batch's denominator when the batch is one part.
def _icepop(logp, batch, hp, whole):
  args = (logp, batch["old_logp"], batch["rollout_logp"], batch["advantages"],
          batch["loss_mask"])
  kw = dict(eps_low=hp["eps_low"], eps_high=hp["eps_high"],
            num_seqs=None if whole is None else whole["seqs"])
  if hp["icepop_beta"] is None:                  # config.rl.icepop=False: the ablation
    return policy_losses.grpo_clip_loss(*args, **kw)
  return policy_losses.icepop_grpo_loss(*args, beta=hp["icepop_beta"], **kw)


def _double_sided_is(logp, batch, hp, whole):
  return policy_losses.double_sided_is_loss(
      logp, batch["rollout_logp"], batch["advantages"], batch["loss_mask"],
      eps_low=hp["eps_low"], eps_high=hp["eps_high"],
      num_tokens=None if whole is None else whole["tokens"])


_POLICY_OBJECTIVES = {"icepop_grpo": _icepop, "double_sided_is": _double_sided_is}
# How the parts' metrics of a policy loss combine (gradient accumulation): extremes by min /
# max, counts by sum, every other metric (a token mean) by its share of the batch's tokens.
_EXTREMES = {"ratio_min": (jnp.minimum, jnp.inf), "ratio_max": (jnp.maximum, -jnp.inf)}
_COUNTS = ("tokens", "seqs", "loss")


def policy_loss_fn(params, batch, *, cfg, stage: str, hp: dict, norm=None):
  """An RL row's loss (`Stage.loss`) on a batch of rollouts, with the policy's forward
  (`policy.policy_forward`, the one the rollout engine runs).

  hp: {"logprob_chunk", "eps_low", "eps_high"} (+ "icepop_beta" for icepop_grpo).
  norm: None, or {"tokens", "seqs": the whole batch's mask tokens and sequences, "parts"}
    for one part of a larger batch: the loss is its share of the whole batch's, and every
    metric is combinable (`_EXTREMES`, `_COUNTS`, token shares) into the whole batch's.
  Returns (loss, (metrics, None)): metrics of the objective plus `loss` and `entropy`.
  """
  logp, ent, _, _ = policy.policy_forward(
      params, batch["tokens"], batch["positions"], batch["segment_ids"],
      cfg=stage_model_config(cfg, stage), chunk_size=hp["logprob_chunk"],
      routing_replay=batch.get("routing"))
  loss, m = _POLICY_OBJECTIVES[get_stage(stage).loss](logp, batch, hp, norm)
  mask = batch["loss_mask"]
  m = {**m, "entropy": policy_losses.token_mean(ent, mask), "loss": loss}
  if norm is not None:
    share = jnp.sum(mask > 0) / jnp.maximum(norm["tokens"], 1.0)
    m = {k: v if k in _EXTREMES or k in _COUNTS else v * share for k, v in m.items()}
  return loss, (m, None)


def _lm_loss(params, batch, *, cfg, stage, hp, norm=None):
  return loss_fn(params, batch, cfg=cfg, stage=stage, loss_chunk=hp["loss_chunk"], norm=norm,
                 qat=hp.get("qat"))


# Stage.loss -> (loss function (params, batch, *, cfg, stage, hp, norm), the whole batch's
# normalisers for gradient accumulation (batch, cfg, stage) -> norm).
LOSSES = {
    "lm": (_lm_loss, lambda b, cfg, stage: {
        "tokens": {o: jnp.sum(targets(b, o)[1]) for o in target_offsets(cfg, stage)}}),
    "icepop_grpo": (policy_loss_fn, lambda b, cfg, stage: _rollout_counts(b)),
    "double_sided_is": (policy_loss_fn, lambda b, cfg, stage: _rollout_counts(b)),
}


def _rollout_counts(b):
  m = b["loss_mask"] > 0
  return {"tokens": jnp.sum(m), "seqs": jnp.sum(jnp.any(m, axis=-1))}


def loss_hparams(c) -> dict:
  """The loss hyper-parameters of config `c`'s stage (the `hp` of `LOSSES`)."""
  if get_stage(c.stage).loss == "lm":
    return {"loss_chunk": c.loss_chunk, "qat": qat_scheme(c)}
  r = c.rl
  hp = {"logprob_chunk": r.logprob_chunk, "eps_low": r.eps_low, "eps_high": r.eps_high}
  if get_stage(c.stage).loss == "icepop_grpo":
    hp["icepop_beta"] = r.icepop_beta if r.get("icepop", True) else None
  return hp


# config.qat.bits -> the quantization format QAT trains for (0: off).
QAT_BITS = {0: None, 4: "int4"}


def qat_scheme(c) -> quant.Scheme | None:
  """The `quant.Scheme` of `config.qat` (None when off or the config has no `qat`)."""
  q = c.get("qat")
  if q is None or QAT_BITS.get(q.bits) is None:
    return None
  return quant.Scheme(QAT_BITS[q.bits], q.group_size, q.targets)


def check_qat(c, shapes) -> None:
  """`config.qat` fits the model and the stage: the group size divides every targeted
  weight's reduction dimension and the stage trains at least one targeted weight (errors
  name the field)."""
  scheme = qat_scheme(c)
  if scheme is None:
    return
  try:
    quant.check_tree(shapes, scheme)
  except ValueError as e:
    raise ValueError(f"config.qat.group_size={scheme.block}: {e}") from None
  frozen = frozen_mask(c.stage)
  mask = frozen(shapes) if frozen else jax.tree.map(lambda _: False, shapes)
  is_frozen = {path_str(p): f for p, f in jax.tree_util.tree_flatten_with_path(mask)[0]}
  trained = [p for p in quant.targeted(shapes, scheme) if not is_frozen[p]]
  if not trained:
    raise ValueError(
        f"config.qat.targets={scheme.targets!r} with config.stage={c.stage!r}: the stage trains "
        f"none of the targeted weights ({get_stage(c.stage).trains}); QAT needs a stage that "
        "trains them (e.g. sft), or qat.bits=0")


def _with_new_bias(layer_params, load, rate):
  router = dict(layer_params["moe"]["router"])
  router["e_score_correction_bias"] = losses.update_routing_bias(
      router["e_score_correction_bias"], load, rate)
  return {**layer_params, "moe": {**layer_params["moe"], "router": router}}


def update_routing_biases(cfg, params, loads, rate: float):
  """Aux-loss-free balancing: moves every MoE layer's bias toward uniform load.

  Args:
    cfg: ModelConfig (which stack and block position holds each MoE layer).
    params: the parameter tree.
    loads: (expert_load [L_moe, E] of the main MoE layers, MTP layer load [E] or None).
    rate: bias update speed (0 disables it).
  """
  expert_load, mtp_load = loads
  if rate == 0.0:
    return params
  params = dict(params)
  row = 0                                       # expert_load rows follow the layer order
  for st in layer_stack.layer_stacks(cfg):
    moe_js = [j for j, kind in enumerate(st.block) if kind.moe]
    if not moe_js:
      continue
    n = st.repeats * len(moe_js)
    stack_load = expert_load[row:row + n].reshape(st.repeats, len(moe_js), -1)
    row += n
    stack = dict(params[st.name])
    for q, j in enumerate(moe_js):
      stack[f"layer_{j}"] = _with_new_bias(stack[f"layer_{j}"], stack_load[:, q], rate)
    params[st.name] = stack
  if mtp_load is not None and "mtp" in params and "moe" in params["mtp"]["layer"]:
    params["mtp"] = {**params["mtp"], "layer": _with_new_bias(params["mtp"]["layer"], mtp_load,
                                                              rate)}
  return params


def _split(x, n: int):
  """[B, ...] -> [n, B / n, ...]; part m holds rows m, m + n, m + 2n, ... (strided, so a
  batch sharded over devices in contiguous blocks keeps every device busy in every part)."""
  return jnp.moveaxis(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 1, 0)


def grads_and_parts(params, batch, *, cfg, stage, loss_chunk=None, microbatches: int = 1,
                    hp=None):
  """Gradient of the batch's loss (`LOSSES[stage's loss]`), its parts and expert loads,
  `microbatches` rows at a time.

  Gradient accumulation: the batch is cut into `microbatches` equal parts (`_split`) run
  one after another by `lax.scan`; each part's loss is its share of the whole batch's
  (the loss's `norm`: the whole batch's token (and, for RL, sequence) counts), so the summed
  gradients and parts equal the whole batch's; expert loads (fractions of equal parts'
  routed slots) are averaged. Returns (grads, parts, (expert_load, mtp_load) or None).
  hp: the loss's hyper-parameters (`loss_hparams`); default {"loss_chunk": loss_chunk}.
  """
  fn, whole = LOSSES[get_stage(stage).loss]
  hp = {"loss_chunk": loss_chunk} if hp is None else hp
  loss = functools.partial(fn, cfg=cfg, stage=stage, hp=hp)
  grad_fn = jax.value_and_grad(loss, has_aux=True)
  if microbatches == 1:
    (_, (parts, load)), grads = grad_fn(params, batch)
    return grads, parts, load
  b = batch["tokens"].shape[0]
  if b % microbatches:
    raise ValueError(f"config.microbatches={microbatches} does not divide the batch's "
                     f"{b} rows")
  norm = {**whole(batch, cfg, stage), "parts": microbatches}
  parts_bt = jax.tree.map(lambda x: _split(x, microbatches), batch)

  def one(part):
    (_, (parts, load)), grads = grad_fn(params, part, norm=norm)
    parts = {k: v for k, v in parts.items() if k != "expert_imbalance"}
    return grads, parts, jax.tree.map(lambda x: x / microbatches, load)

  def body(acc, part):
    (g0, p0, l0), (g, p, l) = acc, one(part)
    p = {k: _EXTREMES.get(k, (jnp.add, 0))[0](p0[k], v) for k, v in p.items()}
    return (jax.tree.map(jnp.add, g0, g), p, jax.tree.map(jnp.add, l0, l)), None

  shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], parts_bt))
  grads0, parts0, load0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  parts0 = {k: jnp.full_like(v, _EXTREMES[k][1]) if k in _EXTREMES else v
            for k, v in parts0.items()}
  (grads, parts, load), _ = jax.lax.scan(body, (grads0, parts0, load0), parts_bt)
  if load is not None:
    parts = {**parts, "expert_imbalance": expert_imbalance(load[0])}
  return grads, parts, load


def train_step(state: TrainState, batch, *, cfg, stage, tx, loss_chunk=None, bias_rate=0.0,
               microbatches: int = 1, hp=None):
  """One optimizer update on `batch` (in `microbatches` parts, see `grads_and_parts`)."""
  grads, parts, load = grads_and_parts(state.params, batch, cfg=cfg, stage=stage,
                                       loss_chunk=loss_chunk, microbatches=microbatches, hp=hp)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if get_stage(stage).lm_loss:                    # the routed layers run forward for the LM
    params = update_routing_biases(cfg, params, jax.lax.stop_gradient(load), bias_rate)
  metrics = {**parts, "grad_norm": optax.global_norm(grads),
             "update_norm": optax.global_norm(updates)}
  return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def eval_step(params, batch, *, cfg, stage, loss_chunk, qat=None):
  """Summed next-token NLL and token count (for held-out loss and bits per byte); with `qat`
  of the quantized model the run trains."""
  _, (parts, _) = loss_fn(params, batch, cfg=cfg, stage=stage, loss_chunk=loss_chunk, qat=qat)
  return {"nll_sum": parts["ce"] * parts["tokens"], "tokens": parts["tokens"],
          "indexer_kl": parts["indexer_kl"]}
