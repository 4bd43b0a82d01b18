"""The trainer's view of the policy: per-token log-probs, entropies and DSA top-k of sampled
sequences, from the model's own forward pass (`nn.GLM5`, the one the trainer differentiates).

`logp_bt[:, t]` is log pi(tokens[:, t] | tokens[:, <t]) under the raw model distribution
(log_softmax of the logits at position t - 1, no temperature), the same quantity the rollout
engine returns for each token it samples; position 0 has no prediction and holds 0. This is
the train side of the paper's train/rollout consistency check (GLM-5 §3: the trainer's
recomputed log-probs and the engine's must agree; slime gates GLM-5 at |diff| < 1e-6).

The [b, t, V] logits never exist at once: `token_logprobs` computes them `chunk_size`
positions at a time and recomputes each chunk in the backward pass (`logprobs.chunked`, as
`losses.chunked_cross_entropy`).

Notation: b batch, t positions, d hidden, V vocab, L layers, K top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import logprobs
from glm5_jax import nn as gnn
from glm5_jax import sharding as shd
from glm5_jax.nn import context_parallel as cp


def token_logprobs(hidden_btd, head_dv, tokens_bt, *, chunk_size: int = 256):
  """(logp [b, t], entropy [b, t]) of each token given the hidden states before it.

  hidden_btd: final-norm hidden states; head_dv: the lm_head kernel. Entry t uses
  hidden[:, t - 1]; entry 0 is 0 for both. Entropy is that of the full next-token
  distribution at t - 1 (a diagnostic; it carries gradient like logp).

  Contiguous chunks of the t - 1 predicting positions (`logprobs.chunked`): `policy_forward`
  hands over all-gathered hidden states, and strided chunks, the same log-probs, would sum
  the head's gradient in another order (other bits than the runs so far).
  """
  logp, ent = logprobs.chunked(logprobs.with_entropy, hidden_btd[:, :-1], head_dv,
                               tokens_bt[:, 1:], chunk_size=chunk_size, strided=False)
  zero = jnp.zeros((tokens_bt.shape[0], 1), jnp.float32)
  return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def policy_forward(params, tokens_bt, positions_bt, segment_ids_bt, *, cfg,
                   chunk_size: int = 256, return_topk: bool = False,
                   return_routing: bool = False, routing_replay=None):
  """(logp [b, t], entropy [b, t], top-k per layer or None, routed experts or None) of
  right-padded rows.

  cfg: the ModelConfig the policy runs (post-training: `attention_type="sparse"`, as the
  engine). MTP is not run: it is not part of the policy.
  return_routing: also return the experts each MoE layer used, int32 [b, t, L_moe, K].
  routing_replay: int32 [b, t, L_moe, K] experts to use (rollout routing replay: the
  engine's records; rows of -1 route as usual), or None.

  Under a mesh with `context > 1` (nn/context_parallel.py) the model runs on the zig-zag
  layout of each row, sharded over `context`; its final hidden states and top-k rows are put
  back in natural order (one all-to-all of [b, t, d]) before the log-probs, whose entry t
  reads position t - 1.
  """
  order = None
  inputs = (tokens_bt, positions_bt, segment_ids_bt)
  if cp.size() > 1:
    order = jnp.asarray(cp.zigzag_order(tokens_bt.shape[1], cp.size()))
    inputs = tuple(cp.permute(x, order) for x in inputs)
    if routing_replay is not None:
      routing_replay = cp.permute(routing_replay, order)
  replay = None if routing_replay is None else jnp.moveaxis(routing_replay, 2, 0)
  out = gnn.GLM5(cfg).apply({"params": params}, *inputs, return_logits=False,
                            return_topk=return_topk, mtp=False, order=order,
                            return_routing=return_routing, routing_replay=replay)
  hidden, topk = out.hidden, out.topk_indices
  routing = None if out.routing is None else jnp.moveaxis(out.routing, 0, 2)
  if order is not None:
    hidden = cp.natural(hidden, order)
    topk = None if topk is None else [None if x is None else cp.natural(x, order)
                                      for x in topk]
    routing = None if routing is None else cp.natural(routing, order)
  logp, ent = token_logprobs(hidden, params["lm_head"]["kernel"], tokens_bt,
                             chunk_size=chunk_size)
  return logp, ent, topk, routing


def jitted_forward(cfg, *, chunk_size: int, mesh=None, param_sh=None, batch_sh=None):
  """`policy_forward` jitted as the trainer runs it: (params, batch dict with tokens,
  positions, segment_ids, and `routing` to replay if present) -> (logp, entropy, top-k,
  routed experts [b, t, L_moe, K] or None without MoE layers). Under `mesh` (more than one
  device) with the parameters' and the batch's shardings, traced and run with the mesh set
  (the MoE's expert axis, context parallelism)."""
  def fwd(params, b):
    return policy_forward(params, b["tokens"], b["positions"], b["segment_ids"], cfg=cfg,
                          chunk_size=chunk_size, return_topk=True, return_routing=True,
                          routing_replay=b.get("routing"))
  if mesh is None or mesh.size == 1:
    jitted = jax.jit(fwd)
    return lambda params, b: jitted(params, {k: b[k] for k in FORWARD_FIELDS if k in b})
  inner = jax.jit(fwd, in_shardings=(param_sh, batch_sh))

  def call(params, b):
    with jax.set_mesh(mesh):
      return inner(params, {k: b[k] for k in FORWARD_FIELDS if k in b})
  return call


FORWARD_FIELDS = ("tokens", "positions", "segment_ids", "routing")


def _keys(slots_k) -> set:
  """The keys a top-k row selects; -1 marks an empty slot (fewer visible keys than slots,
  and the engine's and the trainer's slot counts, min(index_topk, s), may differ)."""
  return set(np.asarray(slots_k).tolist()) - {-1}


def _expert_sets(x_lk) -> list:
  return [frozenset(row) for row in np.asarray(x_lk).tolist()]


def routing_mismatches(trajs, routing_btlk, rows=None) -> tuple[int, int]:
  """(MoE (token, layer) pairs whose experts in the trainer's forward differ, as sets, from
  those the engine recorded; pairs compared), over every position each trajectory's engine
  recorded (`Trajectory.routing`: {position: int32 [L_moe, K]}).

  routing_btlk: the trainer's routed experts int32 [b, t, L_moe, K] (with routing replay,
  the replayed ones); rows: batch row of each trajectory.
  """
  if routing_btlk is None:
    return 0, 0
  trainer = shd.to_host(routing_btlk)
  bad = total = 0
  for i, tr in enumerate(trajs):
    row = i if rows is None else rows[i]
    for pos, eng_lk in (tr.routing or {}).items():
      eng, mine = _expert_sets(eng_lk), _expert_sets(trainer[row, pos])
      total += len(eng)
      bad += sum(a != b for a, b in zip(eng, mine))
  return bad, total


def topk_mismatches(trajs, topk_lbtk, rows=None) -> tuple[int, int]:
  """(positions where some layer's engine top-k set differs from the trainer's, positions
  compared), over every position each trajectory's engine recorded.

  trajs: Trajectory list with `topk` = {position: int32 [L, K]} from the engine
  (`record_topk=True`); topk_lbtk: the trainer's per-layer top-k, [L] of [b, t, K] (layers
  that reuse another layer's selection may be None); rows: batch row of each trajectory.
  """
  layers = shd.to_host(list(topk_lbtk))
  bad = total = 0
  for i, tr in enumerate(trajs):
    row = i if rows is None else rows[i]
    for pos, eng_lk in (tr.topk or {}).items():
      total += 1
      for l, tr_btk in enumerate(layers):
        if tr_btk is None:
          continue
        if _keys(eng_lk[l]) != _keys(tr_btk[row, pos]):
          bad += 1
          break
  return bad, total
