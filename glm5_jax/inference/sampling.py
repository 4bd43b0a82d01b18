"""Sampling: parameters, the sampling distribution, raw log-probs, speculative acceptance.

Order of the logits processors (as in Hugging Face `generate` and vLLM):
temperature, then top-k, then top-p (the smallest set of most likely tokens
whose probability reaches top_p; the most likely token is always kept).
temperature == 0 is greedy: argmax, ties -> lower token id.

Log-probs returned to the caller are always under the RAW model
distribution, log_softmax(logits), before temperature / top-k / top-p: that
is the policy log-prob the RL losses recompute with the trainer's forward.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Alg. 1; Chen et al. 2023): with draft distribution
q and target distribution p (both AFTER the processors above, so the output
follows exactly the distribution plain sampling draws from), draft token x
is accepted with probability min(1, p(x) / q(x)); at the first rejection the
replacement is drawn from norm(max(0, p - q)); when all D drafts are accepted
a bonus token is drawn from p at the next position. Greedy is the one-hot
special case: accept iff the draft equals the target argmax.

Notation: b batch, v vocabulary, D draft tokens.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import logprobs
from glm5_jax import row_reduce


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick the next token.

  Attributes:
    max_new_tokens: generated tokens per request (>= 1), stop token included.
    temperature: 0 = greedy; > 0 divides the logits.
    top_k: keep the k most likely tokens (0 = all).
    top_p: nucleus mass in (0, 1] (1 = all).
    stop_token_ids: generation of a request ends after it emits one of these
      (the stop token is returned with its log-prob).
    seed: base seed; request i of a `generate` call draws from
      fold_in(fold_in(PRNGKey(seed), i), token_index), so the output does not
      depend on which other requests share the batch.
  """
  max_new_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_token_ids: Sequence[int] = ()
  seed: int = 0

  def __post_init__(self):
    stop = self.stop_token_ids
    if isinstance(stop, (str, bytes)) or not isinstance(stop, collections.abc.Iterable):
      raise ValueError(f"SamplingParams.stop_token_ids={stop!r}: expected a sequence of "
                       "token ids (ints >= 0)")
    stop = tuple(stop)
    for i, t in enumerate(stop):
      if not _is_int(t) or t < 0:
        raise ValueError(f"SamplingParams.stop_token_ids[{i}]={t!r}: expected an int >= 0 "
                         "(a token id, not a bool)")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
    if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: expected an "
                       "int >= 1 (not a bool)")
    if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
      raise ValueError(f"SamplingParams.temperature={self.temperature!r}: expected a finite "
                       "number >= 0 (0 = greedy)")
    if not _is_int(self.top_k) or self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k!r}: expected an int >= 0 (0 = off)")
    if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p={self.top_p!r}: expected a number in (0, 1]")
    if not _is_int(self.seed):
      raise ValueError(f"SamplingParams.seed={self.seed!r}: expected an int")


def _is_int(x) -> bool:
  """A Python or NumPy integer; bool (an int subclass) and np.bool_ are not."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
      x, (bool, np.bool_))


def raw_logprobs(logits_bv, tokens_b, kernel: bool = False):
  """log_softmax(logits)[token], float32 [b]: the raw policy log-prob, by the function the
  trainer's log-probs use (`logprobs.of_logits`). kernel: its maximum by
  `row_reduce.row_max` (the CPU engine on one device; the same bits)."""
  return logprobs.of_logits(logits_bv, tokens_b,
                            row_max=row_reduce.row_max if kernel else None)


def sampling_logprobs(logits_bv, temperature_b, top_k_b, top_p_b):
  """log q [b, v] of the sampling distribution (-inf outside its support).

  Greedy rows (temperature 0) give the one-hot distribution of the argmax.
  """
  logits = logits_bv.astype(jnp.float32)
  greedy = temperature_b <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature_b)[:, None]
  argmax_bv = jnp.arange(logits.shape[-1])[None, :] == jnp.argmax(scaled, -1)[:, None]
  filtered = (top_k_b > 0) | (top_p_b < 1)
  # Sorting the vocabulary is the costly part on CPU: only when some row filters.
  keep_bv = jax.lax.cond(jnp.any(filtered & ~greedy), _top_k_top_p_mask,
                         lambda *_: jnp.ones_like(argmax_bv), scaled, top_k_b, top_p_b)
  keep_bv = jnp.where(greedy[:, None], argmax_bv, keep_bv)
  return jax.nn.log_softmax(jnp.where(keep_bv, scaled, -jnp.inf), axis=-1)


def _top_k_top_p_mask(scaled_bv, top_k_b, top_p_b):
  """bool [b, v]: the top-k tokens, then the smallest set reaching mass top_p."""
  v = scaled_bv.shape[-1]
  order_bv = jnp.argsort(-scaled_bv, axis=-1, stable=True)     # descending; ties -> lower id
  sorted_bv = jnp.take_along_axis(scaled_bv, order_bv, axis=-1)
  rank = jnp.arange(v)[None, :]
  k = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, v), v)
  keep = rank < k[:, None]
  probs = jax.nn.softmax(jnp.where(keep, sorted_bv, -jnp.inf), axis=-1)
  keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p_b[:, None]
  rows = jnp.arange(scaled_bv.shape[0])[:, None]
  return jnp.zeros_like(keep).at[rows, order_bv].set(keep)


def sample(keys_b, logq_bv):
  """One token per row from log q (a greedy row's q is one-hot). int32 [b]. When every
  row is greedy, `greedy` gives the same tokens without the random draw (Gumbel noise over
  the whole vocabulary) or the distribution."""
  return jax.vmap(jax.random.categorical)(keys_b, logq_bv).astype(jnp.int32)


def greedy(logits_bv, kernel: bool = False):
  """The argmax per row, ties -> lower token id (a NaN, the first one, ranks highest, as in
  `jnp.argmax`): int32 [..]. The token `sample` draws from a greedy row's one-hot
  `sampling_logprobs`, without building that distribution.

  kernel: by `row_reduce.row_argmax` (the CPU engine on one device: one vectorized pass
  over each row); else as two plain reductions (the maximum, then the lowest index holding
  it), as XLA:CPU runs `jnp.argmax`'s (value, index) reduction element by element, 0.6 ms
  of a 17 ms decode step of `small` at 8 rows x 32,768 tokens. The same index either way."""
  return (row_reduce.row_argmax if kernel else row_reduce.argmax_xla)(logits_bv)


def row_keys(seed_b, request_b, counter_b):
  """fold_in(fold_in(PRNGKey(seed), request), counter) per row: keys [b]."""
  def one(s, r, c):
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), r), c)
  return jax.vmap(one)(seed_b, request_b, counter_b)


def speculative_accept(keys_b, drafts_bd, logq_bdv, logp_bdv):
  """Speculative-sampling acceptance for D drafts per row.

  Args:
    keys_b: PRNG keys [b].
    drafts_bd: int32 [b, D] draft tokens, drafted from q.
    logq_bdv: [b, D, v] draft sampling log-probs.
    logp_bdv: [b, D + 1, v] target sampling log-probs at the D + 1 verified
      positions (the last one gives the bonus token).

  Returns:
    (n_accepted int32 [b] in [0, D], next_token int32 [b]): the output is
    drafts[:n] followed by next_token.
  """
  b, d = drafts_bd.shape
  k_u, k_y = jax.vmap(lambda k: jax.random.split(k, 2))(keys_b).swapaxes(0, 1)
  u_bd = jax.vmap(lambda k: jax.random.uniform(k, (d,)))(k_u)
  lp = jnp.take_along_axis(logp_bdv[:, :d], drafts_bd[..., None], -1)[..., 0]
  lq = jnp.take_along_axis(logq_bdv, drafts_bd[..., None], -1)[..., 0]
  accept_bd = u_bd < jnp.exp(jnp.minimum(lp - lq, 0.0))
  n = jnp.sum(jnp.cumprod(accept_bd.astype(jnp.int32), axis=-1), axis=-1)
  p_n = jnp.take_along_axis(logp_bdv, n[:, None, None], 1)[:, 0]            # [b, v]
  q_n = jnp.take_along_axis(jnp.pad(logq_bdv, ((0, 0), (0, 1), (0, 0)), constant_values=-jnp.inf),
                            n[:, None, None], 1)[:, 0]                       # -inf at n == D
  resid = jnp.maximum(jnp.exp(p_n) - jnp.exp(q_n), 0.0)
  ok = jnp.sum(resid, -1, keepdims=True) > 0
  log_resid = jnp.where(ok, jnp.log(resid), p_n)      # p == q: residual empty, never reached
  return n.astype(jnp.int32), sample(k_y, log_resid)


def greedy_accept(drafts_bd, logits_bdv, kernel: bool = False):
  """`speculative_accept` when every row is greedy (one-hot q and p): the drafts equal to
  the target's argmax are kept up to the first that is not, and the next token is the
  argmax after them. No distributions and no random draws; the same (n_accepted,
  next_token) as `speculative_accept` with the one-hot distributions.

  Args:
    drafts_bd: int32 [b, D] draft tokens.
    logits_bdv: [b, D + 1, v] target logits at the D + 1 verified positions.
    kernel: the argmax by `row_reduce.row_argmax` (`greedy`).
  """
  d = drafts_bd.shape[1]
  target_bt = greedy(logits_bdv, kernel)                                     # [b, D + 1]
  n = jnp.sum(jnp.cumprod((drafts_bd == target_bt[:, :d]).astype(jnp.int32), -1), -1)
  return n.astype(jnp.int32), jnp.take_along_axis(target_bt, n[:, None], 1)[:, 0]
