"""Lightning indexer in XLA: scores and the deterministic causal top-k in plain jnp.

The model's `impl="xla"` path (the CPU default) and the oracle every Pallas kernel is tested
against.

DeepSeek-V3.2 paper §2.1 eq. (1); docs/design.md §2.4:

    I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s])

Notation: b batch, t query positions, s key positions, j indexer heads (h_i),
d indexer head dim (d_i), k top-k. The caller folds the scales into the inputs
(d_i**-0.5 into q, h_i**-0.5 into w): `ReLU(c*x) = c*ReLU(x)` for c > 0.

Query i of a block of t queries sits at absolute position `s - t + i` (prefill:
t == s; decode / chunked prefill: t < s) and by default may see keys
j <= s - t + i (`causal_limit`). A caller may instead pass the last visible key
per query, `limit`: int32 [t] (shared by the batch: context parallelism's
permuted rows) or [b, t] (per row: b sequences over a KV cache, each with its t
new queries at its own positions); with `start` [b, t], query i of row b sees
keys start[b, i] <= j <= limit[b, i], and sees nothing when start > limit.

Determinism: the selection is ordered by descending score, ties broken by the
LOWER key position, and slots beyond the number of visible keys hold -1.
`deterministic_topk` is the one function that implements this rule and the
visibility window; the trainer, the rollout engine and every kernel match it.
The order is `lax.top_k`'s total order on float32: -0.0 ranks below +0.0 (they
are not a tie), +inf above every finite score. A NaN or -inf score makes its key
invisible, like a key outside the window: it is never selected and the -1 tail
takes its place.

`topk_indices_xla` processes queries in chunks (`lax.map`), so peak
memory is O(b * chunk * s), never the full [t, s] score matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _backend


def index_scores(q_btjd, k_bsd, w_btj, einsum=jnp.einsum):
  """I[b, t, s] = sum_j w[b,t,j] * relu(q[b,t,j] . k[b,s]), float32, no mask. einsum:
  computes q . k (`jnp.einsum`'s signature; see `topk_indices_xla`)."""
  qk_btjs = einsum("btjd,bsd->btjs", q_btjd, k_bsd, preferred_element_type=jnp.float32)
  return jnp.einsum("btjs,btj->bts", jax.nn.relu(qk_btjs), w_btj.astype(jnp.float32))


def causal_limit(t: int, s: int):
  """[t] int32: the last key position each query may attend to (s - t + i)."""
  return jnp.arange(t, dtype=jnp.int32) + (s - t)


def deterministic_topk(scores_bts, limit, topk: int, start_bt=None, top_k=None):
  """Top-k over keys start[b, i] <= j <= limit[(b,) i], ties -> lower j, -1 where fewer exist.

  Args:
    scores_bts: [b, t, s] float scores; any value on invisible keys. A NaN or
      -inf score hides its key (never selected, as if outside the window).
    limit: int32 [t] (every row alike; e.g. `causal_limit`) or [b, t] (per
      row), the last visible key per query.
    topk: number of slots.
    start_bt: optional [b, t] int32, first visible key per query (packed
      documents: the query's document start); default 0.
    top_k: what selects (`lax.top_k`'s signature and results; default XLA's); a
      forward-only caller may pass one with the same results, e.g. the CPU inference
      engine's kernel (glm5_jax/cpu_dsa.py).

  Returns:
    int32 [b, t, topk] key positions, descending score (lax.top_k's order:
    -0.0 below +0.0), ties -> lower position, then -1 for every slot beyond
    the number of visible keys with a score that is neither NaN nor -inf.
  """
  s = scores_bts.shape[-1]
  pos_s = jnp.arange(s, dtype=jnp.int32)
  if limit.ndim == 1:
    visible = (pos_s[None, :] <= limit[:, None])[None]
  else:
    visible = pos_s[None, None, :] <= limit[..., None]
  if start_bt is not None:
    visible = visible & (pos_s[None, None, :] >= start_bt[..., None])
  scores = scores_bts.astype(jnp.float32)
  # lax.top_k ranks NaN above +inf: a NaN key is hidden here, or it would take slot 0.
  masked = jnp.where(visible & ~jnp.isnan(scores), scores, -jnp.inf)
  k_eff = min(topk, s)
  # lax.top_k is stable: among equal values the lower index comes first.
  vals, idx = (top_k or _top_k)(masked, k_eff)
  idx = jnp.where(vals > -jnp.inf, idx.astype(jnp.int32), -1)
  if k_eff < topk:
    pad = jnp.full(idx.shape[:-1] + (topk - k_eff,), -1, jnp.int32)
    idx = jnp.concatenate([idx, pad], axis=-1)
  return idx


def _top_k(x, k: int):
  """`lax.top_k(x, k)`, the same values and indices. For k equal to the row length (a decode
  step whose context is within `index_topk`) XLA:CPU lowers top_k to a sort (~110 us for
  [16, 64] on this project's 2-core VM, where its top_k of k - 1 takes ~23 us): the first
  k - 1 come from top_k, the last is the one index left (the indices' sum minus theirs,
  exact in wrapping int32)."""
  n = x.shape[-1]
  if k != n or n < 2:
    return jax.lax.top_k(x, k)
  vals, idx = jax.lax.top_k(x, n - 1)
  rest = (jnp.sum(jnp.arange(n, dtype=jnp.int32))
          - jnp.sum(idx.astype(jnp.int32), axis=-1, keepdims=True))
  return (jnp.concatenate([vals, jnp.take_along_axis(x, rest, axis=-1)], axis=-1),
          jnp.concatenate([idx.astype(jnp.int32), rest], axis=-1))


def topk_indices_xla(q, k, w, topk: int, *, chunk_size: int = 512, start=None,
                     limit=None, einsum=jnp.einsum, top_k=None):
  """Chunked jnp lightning-indexer top-k (the `impl="xla"` path).

  Args:
    q: [b, t, h_i, d_i] indexer queries, RoPE applied, d_i**-0.5 folded in.
    k: [b, s, d_i] indexer keys, RoPE applied.
    w: [b, t, h_i] per-head weights, h_i**-0.5 folded in.
    topk: slots per query.
    chunk_size: queries scored at once; peak memory O(b * chunk * s).
    start: optional [b, t] int32 first visible key per query (packed documents).
    limit: optional int32 [t] or [b, t], last visible key per query (default
      `causal_limit`; context parallelism's permuted rows pass each query's
      natural position as [t]; a KV-cache forward passes each row's own
      positions as [b, t]).
    einsum: computes the queries' products with the keys (`jnp.einsum`'s signature; a
      forward-only caller may pass one with the same numbers, e.g. the CPU inference
      engine's kernel).
    top_k: what selects the top-k (see `deterministic_topk`).

  Returns:
    int32 [b, t, topk].
  """
  b, t, _, _ = q.shape
  s = k.shape[1]
  c = max(1, min(chunk_size, t))
  n_chunks = -(-t // c)
  limit = causal_limit(t, s) if limit is None else limit.astype(jnp.int32)
  if limit.ndim == 1:
    limit = _backend.pad_to(limit, 0, c).reshape(n_chunks, c)
  else:                                     # [b, t] -> [n, b, c], like start
    limit = _backend.pad_to(limit, 1, c).reshape(b, n_chunks, c).swapaxes(0, 1)
  q_c = _backend.pad_to(q, 1, c).reshape(b, n_chunks, c, *q.shape[2:]).swapaxes(0, 1)
  w_c = _backend.pad_to(w, 1, c).reshape(b, n_chunks, c, w.shape[-1]).swapaxes(0, 1)
  start = jnp.zeros((b, t), jnp.int32) if start is None else start.astype(jnp.int32)
  s_c = _backend.pad_to(start, 1, c).reshape(b, n_chunks, c).swapaxes(0, 1)

  def one_chunk(args):
    q_bcjd, w_bcj, limit_c, start_bc = args
    return deterministic_topk(index_scores(q_bcjd, k, w_bcj, einsum), limit_c, topk,
                              start_bc, top_k)

  idx = jax.lax.map(one_chunk, (q_c, w_c, limit, s_c))  # [n, b, c, topk]
  return idx.swapaxes(0, 1).reshape(b, n_chunks * c, topk)[:, :t]
