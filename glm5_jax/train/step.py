"""Train and eval steps: losses per stage, optimizer update, routing-bias update.

Stages (design.md decision 6; paper §2 "DSA"):
  pretrain / midtrain  dense MLA attention; LM + MTP losses; the indexer is frozen.
  dsa_warmup           dense attention; everything frozen but the indexer, which
                       learns from the dense indexer KL (DeepSeek-V3.2 eq. 3).
  dsa_sparse           top-k sparse attention; all parameters train; the indexer
                       learns from the sparse KL with detached inputs (eq. 4).
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from glm5_jax import losses
from glm5_jax import nn as gnn
from glm5_jax import optim

STAGES = ("pretrain", "midtrain", "dsa_warmup", "dsa_sparse")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def stage_model_config(cfg, stage: str):
  """The ModelConfig a stage runs: dense attention before sparse adaptation."""
  if stage not in STAGES:
    raise ValueError(f"config.stage={stage!r}: expected one of {STAGES}")
  return cfg.replace(attention_type="sparse" if stage == "dsa_sparse" else "dense")


def frozen_mask(stage: str):
  """optax-style mask of parameters that must not change in `stage`."""
  if stage == "dsa_warmup":
    return optim.path_mask("indexer", invert=True)
  if stage in ("pretrain", "midtrain"):
    return optim.path_mask("indexer")
  return None


def make_schedule(c, peak: float | None = None) -> optax.Schedule:
  """Linear warmup then cosine decay to `final_lr_fraction` of the peak."""
  peak = c.learning_rate if peak is None else peak
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=c.warmup_steps,
      decay_steps=max(c.total_steps, c.warmup_steps + 1), end_value=peak * c.final_lr_fraction)


def make_optimizer(c) -> optax.GradientTransformation:
  """Gradient clipping, then Muon Split (or AdamW for ablations) with the stage's mask."""
  sched = make_schedule(c)
  frozen = frozen_mask(c.stage)
  if c.optimizer == "muon_split":
    adam = make_schedule(c, c.adam_learning_rate) if c.adam_learning_rate else None
    tx = optim.muon_split(learning_rate=sched, adam_learning_rate=adam,
                          weight_decay=c.weight_decay, frozen=frozen)
  elif c.optimizer == "adamw":
    def labels(p):
      fr = frozen(p) if frozen else _false(p)
      return jax.tree.map(lambda a, b: "frozen" if (a or b) else "train", _fixed(p), fr)
    tx = optax.multi_transform(
        {"train": optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=c.weight_decay),
         "frozen": optax.set_to_zero()}, labels)
  else:
    raise ValueError(f"config.optimizer={c.optimizer!r}: expected 'muon_split' or 'adamw'")
  return optax.chain(optax.clip_by_global_norm(c.grad_clip), tx)


def _fixed(p):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "e_score_correction_bias" in jax.tree_util.keystr(path), p)


def _false(p):
  return jax.tree.map(lambda _: False, p)


def targets(batch, offset: int):
  """Targets at `offset` and their mask (same document, not padding)."""
  return losses.next_token_targets(batch["tokens"], offset=offset,
                                   segment_ids=batch["segment_ids"])


def loss_fn(params, batch, *, cfg, stage: str, loss_chunk: int):
  """Total loss and its parts for one batch {tokens, segment_ids, positions}."""
  mcfg = stage_model_config(cfg, stage)
  with_kl = stage in ("dsa_warmup", "dsa_sparse")
  out = gnn.GLM5(mcfg).apply({"params": params}, batch["tokens"], batch["positions"],
                             batch["segment_ids"], with_indexer_loss=with_kl,
                             return_logits=False)
  head = params["lm_head"]["kernel"]
  y, m = targets(batch, 1)
  ce, n_tok = losses.chunked_cross_entropy(out.hidden, head, y, m, chunk_size=loss_chunk)
  mtp_ce = []
  if out.mtp_hidden is not None and stage != "dsa_warmup":
    for k in range(mcfg.mtp_num_steps):
      yk, mk = targets(batch, k + 2)
      mtp_ce.append(losses.chunked_cross_entropy(out.mtp_hidden[k], head, yk, mk,
                                                 chunk_size=loss_chunk)[0])
  mtp = losses.mtp_loss(mtp_ce, mcfg.mtp_loss_weight)
  kl = jnp.zeros(()) if out.indexer_kl is None else jnp.sum(out.indexer_kl)
  n_kl_layers = max(1, mcfg.num_hidden_layers)
  if out.mtp_indexer_kl is not None:            # the shared MTP layer's indexer, once
    kl = kl + jnp.mean(out.mtp_indexer_kl)
    n_kl_layers += 1
  if stage == "dsa_warmup":
    total = kl                                    # only the indexer trains
  else:
    total = ce + mtp + mcfg.indexer_loss_coeff * kl
  load = out.expert_load
  parts = {"loss": total, "ce": ce, "mtp": mtp, "indexer_kl": kl / n_kl_layers,
           "tokens": n_tok,
           "expert_imbalance": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
           if load.size else jnp.zeros(())}
  mtp_load = None if out.mtp_expert_load is None else jnp.mean(out.mtp_expert_load, axis=0)
  return total, (parts, (load, mtp_load))


def _with_new_bias(layer_params, load, rate):
  router = dict(layer_params["moe"]["router"])
  router["e_score_correction_bias"] = losses.update_routing_bias(
      router["e_score_correction_bias"], load, rate)
  return {**layer_params, "moe": {**layer_params["moe"], "router": router}}


def update_routing_biases(params, loads, rate: float):
  """Aux-loss-free balancing: moves every MoE layer's bias toward uniform load.

  Args:
    params: the parameter tree.
    loads: (expert_load [L_moe, E] of the main MoE layers, MTP layer load [E] or None).
    rate: bias update speed (0 disables it).
  """
  expert_load, mtp_load = loads
  if rate == 0.0:
    return params
  params = dict(params)
  moe_layers = sorted((k for k in params if k.startswith("layers_") and "moe" in params[k]),
                      key=lambda k: int(k.split("_")[1]))
  for layer, load in zip(moe_layers, expert_load):
    params[layer] = _with_new_bias(params[layer], load, rate)
  if mtp_load is not None and "mtp" in params and "moe" in params["mtp"]["layer"]:
    params["mtp"] = {**params["mtp"], "layer": _with_new_bias(params["mtp"]["layer"], mtp_load,
                                                              rate)}
  return params


def train_step(state: TrainState, batch, *, cfg, stage, tx, loss_chunk, bias_rate):
  (_, (parts, load)), grads = jax.value_and_grad(
      lambda p: loss_fn(p, batch, cfg=cfg, stage=stage, loss_chunk=loss_chunk),
      has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if stage != "dsa_warmup":
    params = update_routing_biases(params, jax.lax.stop_gradient(load), bias_rate)
  metrics = {**parts, "grad_norm": optax.global_norm(grads),
             "update_norm": optax.global_norm(updates)}
  return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def eval_step(params, batch, *, cfg, stage, loss_chunk):
  """Summed next-token NLL and token count (for held-out loss and bits per byte)."""
  _, (parts, _) = loss_fn(params, batch, cfg=cfg, stage=stage, loss_chunk=loss_chunk)
  return {"nll_sum": parts["ce"] * parts["tokens"], "tokens": parts["tokens"],
          "indexer_kl": parts["indexer_kl"]}
