"""Token log-probs under the language-model head: log p(y | h) = log_softmax(h @ W)[y].

  of_logits      log_softmax(logits)[y] from float logits: the rollout engine's raw log-probs
                 (`inference.sampling.raw_logprobs`) and, chunk by chunk, the long-context
                 eval's losses (`evals.long_context.nll_fn`).
  with_entropy   the same, plus the entropy of each position's distribution: the RL
                 policy's log-probs (`policy.token_logprobs`), chunk by chunk.
  chunked        any such per-position statistic of h @ W over a sequence, `chunk_size`
                 positions at a time: the [b, t, V] logits never exist at once, and each
                 chunk's are recomputed in the backward pass (`jax.checkpoint`; GLM-5 paper
                 §2: sequence-chunked output projection + cross entropy). The trainer's cross
                 entropy (`losses.chunked_cross_entropy`), the RL policy and the eval run
                 through it.

Bit for bit, not only in value: the rollout engine's log-probs must equal the trainer's
(GLM-5 §3; tests/rl/test_grpo.py compares them at ATOL 0), and a run must not move when its
code is reorganised. So each caller keeps its own arithmetic, chosen by arguments:
  - the statistic. The cross entropy sums logsumexp - logit[y] over each chunk (its
    `_nll_sum`); -of_logits, (logit[y] - max) - log sum exp(logit - max), rounds
    differently in the last bit.
  - the chunk layout (`padding.chunks`). Strided chunks keep a context-sharded sequence
    sharded (the cross entropy runs on the zig-zag rows of nn/context_parallel.py);
    contiguous chunks are the policy's, which all-gathers its hidden states first. The
    per-position values are the same in both layouts (to the bit on CPU, numerics.py), the
    head's gradient is not: it sums over a chunk's positions, and the layout decides which
    positions share a chunk.
  - `total`: the cross entropy adds its per-chunk sums in a scan carry, in chunk order.

Notation: b batch, t positions, c positions per chunk, d hidden, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax import padding


def _pick(x_btv, y_bt):
  return jnp.take_along_axis(x_btv, y_bt[..., None], axis=-1)[..., 0]


def log_softmax(x, row_max):
  """`jax.nn.log_softmax(x, axis=-1)`'s arithmetic, op for op, with its maximum over the last
  axis from `row_max` (one that gives `jnp.max`'s bits: `row_reduce.row_max`); its input's
  gradient stopped, as jax stops the maximum's."""
  shifted = x - row_max(jax.lax.stop_gradient(x))[..., None]
  return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def of_logits(logits_btv, y_bt, row_max=None):
  """log_softmax(logits)[y]: float32 [...] from logits [..., V] (any float dtype) and token
  ids y [...]. row_max: None (`jax.nn.log_softmax`), or the maximum `log_softmax` takes
  (the CPU engine's `row_reduce.row_max`: the same bits, tests/test_row_reduce.py)."""
  x = logits_btv.astype(jnp.float32)
  return _pick(jax.nn.log_softmax(x, axis=-1) if row_max is None else log_softmax(x, row_max),
               y_bt)


def with_entropy(logits_btv, y_bt):
  """(log_softmax(logits)[y], entropy -sum_v p_v log p_v), float32 [...] each; the entropy is
  a diagnostic and carries gradient like the log-prob."""
  logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  return _pick(logp_btv, y_bt), -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)


def chunked(stat, hidden_btd, head_dv, *per_position, chunk_size: int = 256,
            strided: bool = True, total: bool = False):
  """`stat(logits_bcv, *per_position_bc)` over the positions of hidden [b, t, d], `chunk_size`
  positions at a time; logits = hidden @ head float32 [b, c, V] (head [d, V] cast to hidden's
  dtype).

  per_position: arrays [b, t, ...] chunked alongside hidden (targets, masks), their padding 0.
  strided: the chunk layout (`padding.chunks`; see the module docstring).
  Returns stat's outputs ([b, c] arrays, pytree as stat returns it) put back as [b, t], or
  with `total` the sum of stat's scalars over the chunks, added in chunk order.
  """
  t = hidden_btd.shape[1]
  c = max(1, min(chunk_size, t))
  xs = tuple(padding.chunks(x, c, strided=strided) for x in (hidden_btd, *per_position))

  @jax.checkpoint
  def chunk(h_bcd, *per_position_bc):
    logits = jnp.einsum("bcd,dv->bcv", h_bcd, head_dv.astype(h_bcd.dtype),
                        preferred_element_type=jnp.float32)
    return stat(logits, *per_position_bc)

  if total:
    out, _ = jax.lax.scan(lambda acc, x: (acc + chunk(*x), None), jnp.zeros((), jnp.float32),
                          xs)
    return out
  out = jax.lax.map(lambda x: chunk(*x), xs)
  return jax.tree.map(lambda o: padding.unchunk(o, t, strided=strided), out)
