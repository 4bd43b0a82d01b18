"""Train/rollout consistency: how far the trainer's forward is from the engine that sampled.

GLM-5 (arXiv 2602.15763, §3) trains on the engine's tokens as they were sampled (TITO), so
the trainer's recomputed log-probs, DSA top-k and MoE routing are compared with what the
engine recorded on every batch of both loops: log-prob |diff|, the k3 mismatch KL, and the
rates of positions whose top-k differs and of (token, layer) pairs whose experts differ
(`consistency_metrics`; `per_version_metrics` when the batch's tokens were sampled by several
weight versions, each compared under its own).
"""

from __future__ import annotations

import dataclasses

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import numerics
from glm5_jax import policy
from glm5_jax import sharding as shd
from glm5_jax.rl.algorithm import trajectory as traj_lib


def mismatch_metrics(bad_topk, topk_positions, bad_routing, routing_pairs) -> dict:
  """DSA top-k and MoE routing mismatch counts and rates (0 when nothing was compared)."""
  return {"topk_mismatches": float(bad_topk), "topk_positions": float(topk_positions),
          "topk_mismatch_rate": bad_topk / topk_positions if topk_positions else 0.0,
          "routing_mismatches": float(bad_routing), "routing_pairs": float(routing_pairs),
          "routing_mismatch_rate": bad_routing / routing_pairs if routing_pairs else 0.0}


def consistency_metrics(batch, old_logp_bt, topk, trajs, routing=None) -> dict:
  """Train/rollout agreement on the response tokens of `batch`: log-prob |diff| (max, mean),
  the k3 mismatch KL (rollout || train), the positions where some layer's top-k differs and
  the MoE (token, layer) pairs whose experts differ (`policy.routing_mismatches`).
  old_logp_bt: the trainer's log-probs [b, t]; topk: its per-layer top-k [L] of [b, t, K];
  routing: the experts its forward used [b, t, L_moe, K] (replayed ones under R3)."""
  mask = batch.loss_mask > 0
  x = (batch.rollout_logp - shd.to_host(old_logp_bt).astype(np.float64))[mask]
  bad, total = policy.topk_mismatches(trajs, topk) if topk is not None else (0, 0)
  return {"logp_abs_diff_max": float(np.abs(x).max(initial=0.0)),
          "logp_abs_diff_mean": float(np.abs(x).mean()) if x.size else 0.0,
          "mismatch_kl_k3": float(np.mean(np.exp(-x) - 1 + x)) if x.size else 0.0,
          **mismatch_metrics(bad, total, *policy.routing_mismatches(trajs, routing)),
          "routing_bytes_per_token": traj_lib.routing_bytes_per_token(trajs)}


def warn_without_batch_invariance() -> None:
  """Logs a warning when XLA:CPU runs without batch-invariant dots (numerics.py): the
  engine's and the trainer's log-probs then differ in the last bits."""
  if jax.default_backend() == "cpu" and not numerics.is_set():
    logging.warning("XLA:CPU without batch-invariant dots: the engine's and the trainer's "
                    "log-probs will differ in the last bits (glm5_jax/numerics.py)")


def per_version_metrics(logprobs, snapshots: dict, batch, segs, dev=None) -> dict:
  """Train/rollout agreement, each token under the version that sampled it: log-prob |diff|
  (max, mean), top-k mismatches (positions whose engine top-k set differs in some layer) and
  MoE routing mismatches ((token, layer) pairs whose experts differ; 0 under routing replay,
  whose experts `dev` carries). dev: `batch` on the trainer's devices (default: placed here
  on the default device)."""
  if dev is None:
    dev = {k: jnp.asarray(getattr(batch, k)) for k in ("tokens", "positions", "segment_ids")}
  mask = batch.loss_mask > 0
  diffs, counts, unmeasured = [], np.zeros(4, np.int64), 0
  for v in sorted(set(batch.versions[mask].tolist())):
    sel = mask & (batch.versions == v)
    if v not in snapshots:
      unmeasured += int(sel.sum())
      continue
    logp, _, topk, experts = logprobs(snapshots[v], dev)
    diffs.append(np.abs(batch.rollout_logp[sel] - np.asarray(logp, np.float64)[sel]))
    # The top-k and the experts at position p made the logits of the token at p + 1: compare
    # where that token was sampled by version v.
    mine = []
    for tr in segs:
      ok = lambda p, tr=tr: p + 1 < len(tr.versions) and tr.versions[p + 1] == v
      mine.append(dataclasses.replace(
          tr, topk={p: x for p, x in (tr.topk or {}).items() if ok(p)},
          routing={p: x for p, x in (tr.routing or {}).items() if ok(p)}))
    counts += (*policy.topk_mismatches(mine, topk), *policy.routing_mismatches(mine, experts))
  d = np.concatenate(diffs) if diffs else np.zeros(0)
  return {"logp_abs_diff_max": float(d.max(initial=0.0)),
          "logp_abs_diff_mean": float(d.mean()) if d.size else 0.0,
          **mismatch_metrics(*(int(x) for x in counts)),
          "routing_bytes_per_token": traj_lib.routing_bytes_per_token(segs),
          "logp_unmeasured_tokens": float(unmeasured)}
