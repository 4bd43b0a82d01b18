"""SwiGLU feed-forward computations: the dense block, and the routed experts' kernels.

The MoE (nn/moe.py, docs/design.md §2.6) routes each of n tokens to K of E experts and runs
them through `routed_swiglu` with one of the kernels below (its `select_dispatch`; the
expert-parallel path of nn/moe_ep.py runs `ragged_swiglu` on each device's local experts):

  kernel           platform        regime                 how
  ragged_swiglu    TPU, GPU        n*K >= E               sort by expert + jax.lax.ragged_dot
  gathered_swiglu  TPU, GPU        n*K <  E (decode)      gather each token's K matrices
  blocked_swiglu   CPU (any n)     replaces both on CPU   sort, pad per expert to blocks of
                                                          B rows, dense batched matmuls
  looped_swiglu    CPU, engine     over a KV cache        the same blocks, a loop over the
                                  (no gradient)          blocks in use (same bits)

Notation: n tokens, d hidden, E routed experts, K experts per token, I expert width.

Expert weights may be quantized (`quant.QArray`, the inference engine's INT4 / FP8 weights):
the gathered and blocked kernels gather the experts they use from the packed values and
dequantize only those; the ragged kernel dequantizes all E (it reads them all anyway).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax import quant
from glm5_jax import stream_matmul
from glm5_jax.nn import params as P


class MLP(nn.Module):
  """Dense SwiGLU FFN (layers < first_k_dense_replace, and the shared expert)."""
  cfg: "ModelConfig"  # noqa: F821
  width: int
  axis: str = "mlp"

  @nn.compact
  def __call__(self, x_btd):
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    d, f, init, pd = cfg.hidden_size, self.width, P.dense_init(self.cfg), cfg.param_dtype
    w_gate = P.param(self, "w_gate", init, (d, f), ("embed", self.axis), pd)
    w_up = P.param(self, "w_up", init, (d, f), ("embed", self.axis), pd)
    w_down = P.param(self, "w_down", init, (f, d), (self.axis, "embed"), pd)
    x = x_btd.astype(dt)
    h = (jax.nn.silu(P.dense(self, "w_gate", x, w_gate.astype(dt)))
         * P.dense(self, "w_up", x, w_up.astype(dt)))
    return P.dense(self, "w_down", h, w_down.astype(dt))


def routed_swiglu(kernel, x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid, *,
                  cpu=None):
  """sum_k weights[n,k] * Expert_{ids[n,k]}(x[n]): `kernel` on TPU and GPU, `cpu` (default
  `blocked_swiglu`; `looped_swiglu` for the engine) on XLA:CPU. Returns (y [n, d], tokens
  per expert int32 [E]).

  The choice is made when the program is lowered (`jax.lax.platform_dependent`), so a CPU
  host compiling for a TPU gets the TPU's kernel. On XLA:CPU `ragged_dot` costs about E
  dense matmuls over all n*K rows; `blocked_swiglu` does n*K rows plus padding, and its rows
  do not depend on the other rows at any n, which the engine's batch invariance relies on.
  """
  return jax.lax.platform_dependent(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi,
                                    w_down_eid, cpu=cpu or blocked_swiglu, default=kernel)


def _counts(ids_nk, e):
  return jnp.bincount(ids_nk.reshape(-1), length=e).astype(jnp.int32)


def _sort_by_expert(ids_nk, by_rank: bool = False):
  """(order [n*K]: pair indices sorted by expert, stable; token_of [n*K]: their tokens).
  by_rank: the same order from each pair's rank (pairs of a lower expert, or of its expert
  and earlier), compared all against all: for a decode step's few pairs (XLA:CPU sorted 64
  in ~15 us)."""
  ids = ids_nk.reshape(-1)
  if by_rank:
    i = jnp.arange(ids.shape[0])
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None])
                                              & (i[None, :] < i[:, None]))
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)
    order = jnp.zeros_like(rank).at[rank].set(i.astype(jnp.int32), unique_indices=True)
  else:
    order = jnp.argsort(ids, stable=True)
  return order, order // ids_nk.shape[1]


def ragged_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid):
  """sum_k weights[n,k] * Expert_{ids[n,k]}(x[n]) via sort + `jax.lax.ragged_dot` (dropless;
  one group of rows per expert). Returns (y [n, d], tokens per expert int32 [E])."""
  e = w_gate_edi.shape[0]
  w_gate_edi, w_up_edi, w_down_eid = map(quant.materialize, (w_gate_edi, w_up_edi, w_down_eid))
  order, token_of = _sort_by_expert(ids_nk)
  xs = x_nd[token_of]                                            # [n*K, d], sorted by expert
  group_sizes = _counts(ids_nk, e)
  h = (jax.nn.silu(jax.lax.ragged_dot(xs, w_gate_edi, group_sizes))
       * jax.lax.ragged_dot(xs, w_up_edi, group_sizes))
  ys = jax.lax.ragged_dot(h, w_down_eid, group_sizes)            # [n*K, d]
  ys = ys * weights_nk.reshape(-1)[order][:, None].astype(ys.dtype)
  y = jnp.zeros_like(x_nd).at[token_of].add(ys)
  return y, group_sizes


def block_rows(n_pairs: int, n_experts: int, smallest: int = 16) -> int:
  """`blocked_swiglu`'s rows per block: about the mean rows per expert, a power of two in
  [smallest, 128] (measured on XLA:CPU: smaller blocks copy more expert matrices, larger
  ones pad more rows). Any block of 8 rows or more gives each row the same bits
  (glm5_jax/numerics.py), so the choice never changes a result."""
  mean = max(n_pairs // n_experts, 1)
  return min(128, max(smallest, 1 << (mean.bit_length() - 1)))


def blocked_rows(n_pairs: int, n_experts: int, smallest: int = 16) -> int:
  """Rows `blocked_swiglu` computes (a static count, padding included): at most
  min(E, n*K) experts have rows, each padded by at most B - 1, in whole blocks of B."""
  b = block_rows(n_pairs, n_experts, smallest)
  return (n_pairs + min(n_experts, n_pairs) * (b - 1)) // b * b


def _blocks(x_nd, ids_nk, e: int, b: int, nb: int, engine: bool = False):
  """The blocked layout: the n*K (token, expert) pairs sorted by expert, each expert's rows
  padded to whole blocks of b rows. Returns (xs [nb, b, d] (padding rows zero), row [n*K]:
  each sorted pair's padded row, order [n*K], token_of [n*K], sizes [E], block_expert [nb]:
  the expert of each block (blocks past the last used one: any), used: int32 [] blocks
  that hold rows).

  engine: for the engine's forward, never differentiated (the two forms' gradients could
  add a token's rows in another order), the same values: xs as one gather of each padded
  row's token, not rows scattered into a zero buffer (at a decode step of `small`, 16
  tokens, filling and scattering a [288, 512] buffer took ~50 us a layer), the pairs
  ordered by rank (`_sort_by_expert`) up to 256 pairs, and each block's expert found by
  comparing its first row with every expert's end."""
  n, k = ids_nk.shape
  order, token_of = _sort_by_expert(ids_nk, by_rank=engine and n * k <= 256)
  sizes = _counts(ids_nk, e)
  padded = (sizes + b - 1) // b * b                              # [E] rows, whole blocks
  padded_end = jnp.cumsum(padded)
  expert_of = ids_nk.reshape(-1)[order]                          # [n*K], sorted
  rank = jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[expert_of]
  row = (padded_end - padded)[expert_of] + rank                  # each pair's padded row
  if engine:
    src = jnp.full((nb * b,), n, jnp.int32).at[row].set(token_of)   # n: a padding row
    xs = jnp.where((src < n)[:, None], x_nd[jnp.minimum(src, n - 1)], 0).astype(x_nd.dtype)
  else:
    xs = jnp.zeros((nb * b, x_nd.shape[1]), x_nd.dtype).at[row].set(x_nd[token_of])
  # (the engine's: all against all; XLA:CPU ran the default scan as a while loop, ~19 us)
  block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(nb) * b, side="right",
                                              method="compare_all" if engine else "scan"),
                             e - 1)
  return xs.reshape(nb, b, -1), row, order, token_of, sizes, block_expert, padded_end[-1] // b


def _combine(x_nd, ys_rd, row, order, token_of, weights_nk):
  """y [n, d]: each token's K expert outputs (padded rows `row` of ys), weighted, summed in
  sorted-pair order."""
  ys = ys_rd[row]                                                # [n*K, d], sorted
  ys = ys * weights_nk.reshape(-1)[order][:, None].astype(ys.dtype)
  return jnp.zeros_like(x_nd).at[token_of].add(ys)


def blocked_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid):
  """`ragged_swiglu`'s result as dense batched matmuls over blocks of B rows of one expert.

  Each expert's rows (sorted by expert) are padded to a multiple of B = `block_rows`, in
  nb = `blocked_rows` / B blocks (a static count, enough for any routing). Block j
  multiplies its [B, d] rows by its expert's matrices, gathered per block. Work is n*K rows
  plus the padding, not ragged_dot's E x n*K on XLA:CPU, and each expert matrix is read
  once per block (a few tokens read only their experts', like `gathered_swiglu`). Padding
  rows are zero and never read back. Each row's result does not depend on the other rows
  (every block is a [B, d] matmul, B >= 16).
  """
  n, k = ids_nk.shape
  e, d = w_gate_edi.shape[0], x_nd.shape[1]
  b = block_rows(n * k, e)
  nb = blocked_rows(n * k, e) // b
  xs, row, order, token_of, sizes, block_expert, _ = _blocks(x_nd, ids_nk, e, b, nb)
  w_gate, w_up, w_down = (quant.materialize(quant.take(w, block_expert, axis=0))
                          for w in (w_gate_edi, w_up_edi, w_down_eid))
  h = (jax.nn.silu(jnp.einsum("bsd,bdi->bsi", xs, w_gate))
       * jnp.einsum("bsd,bdi->bsi", xs, w_up))
  ys = jnp.einsum("bsi,bid->bsd", h, w_down).reshape(nb * b, d)
  return _combine(x_nd, ys, row, order, token_of, weights_nk), sizes


def looped_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid, layer=None,
                  stream: bool = False):
  """`blocked_swiglu`'s result (the same bits), computing only the blocks that hold rows:
  a loop over them, each taking its expert's matrices and running three [B, d] matmuls.
  For the engine's forward over a KV cache, never differentiated (a loop of dynamic length).

  The batched kernel's static block count covers any routing, min(E, n*K) experts each
  with a partial block: at decode sizes most of its blocks are empty or nearly so, and it
  copies every block's matrices into one [nb, d, I] buffer before multiplying. Here the
  loop runs the blocks in use, each expert's matrices copied into a buffer that stays in
  cache, in blocks of B >= 8 rows (`block_rows(..., smallest=8)`; a decode step of one
  request, whose idle lanes mirror it, gives each of its K experts 8 rows).

  layer: None, or the entry of stacked weights [R, E, ...] (a scanned stack's, passed whole
  with the repeat's index, nn/layer_stack.py): each block then reads its expert's matrices
  out of the stack; a stack sliced per layer outside the loop would be copied whole, every
  layer and step, before the loop could start.
  stream: no loop; each of the three matmuls is one call of the streamed CPU kernel over
  every block in use (glm5_jax/stream_matmul.py `grouped_matmul`: the same bits, each
  expert's matrix read once, straight from the (stacked) weights, no copy, mirrored rows
  computed once, the matrices streamed one after another with no call per block); float32
  weights only (the engine's `stream_plan`). Its blocks have any number of rows (the kernel
  gives every row count the same bits; an expert's consecutive blocks are one product):
  about the mean rows per expert (`block_rows(..., smallest=1)`), so that the steps around
  the products (the blocked rows' gather, the SwiGLU) run over few padding rows (at a
  decode step of `small`, 16 tokens: 96 rows, not 288).
  """
  n, k = ids_nk.shape
  e, d = w_gate_edi.shape[-3], x_nd.shape[1]
  smallest = 1 if stream else 8
  b = block_rows(n * k, e, smallest=smallest)
  nb = blocked_rows(n * k, e, smallest=smallest) // b
  xs, row, order, token_of, sizes, block_expert, used = _blocks(x_nd, ids_nk, e, b, nb,
                                                                engine=True)

  if stream:   # one call per matrix kind, its blocks in use streamed one after another
    at = block_expert if layer is None else layer * e + block_expert
    matmul = lambda x, w: stream_matmul.grouped_matmul(x, w.reshape(-1, *w.shape[-2:]), at,
                                                       used)
    h = jax.nn.silu(matmul(xs, w_gate_edi)) * matmul(xs, w_up_edi)
    ys = matmul(h, w_down_eid)
    return _combine(x_nd, ys.reshape(nb * b, d), row, order, token_of, weights_nk), sizes

  def expert(w, i):
    at = (i,) if layer is None else (layer, i)
    return quant.materialize(jax.tree.map(lambda a: a[at], w), x_nd.dtype)

  def block(j, ys):
    x, i = xs[j], block_expert[j]
    h = (jax.nn.silu(jnp.einsum("sd,di->si", x, expert(w_gate_edi, i)))
         * jnp.einsum("sd,di->si", x, expert(w_up_edi, i)))
    return ys.at[j].set(jnp.einsum("si,id->sd", h, expert(w_down_eid, i)))

  ys = jax.lax.fori_loop(0, used, block, jnp.zeros((nb, b, d), x_nd.dtype))
  return _combine(x_nd, ys.reshape(nb * b, d), row, order, token_of, weights_nk), sizes


def gathered_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid):
  """sum_k weights[n,k] * Expert_{ids[n,k]}(x[n]) via a gather of each token's K experts.

  Same contract as `ragged_swiglu`: returns (y [n, d], tokens per expert int32 [E]).
  Reads n*K expert matrices ([n, K, d, I]); meant for n*K < E (see module docstring).
  """
  e = w_gate_edi.shape[0]
  wg, wu, wd = (quant.materialize(quant.take(w, ids_nk, axis=0))            # [n, K, ...]
                for w in (w_gate_edi, w_up_edi, w_down_eid))
  h = (jax.nn.silu(jnp.einsum("nd,nkdi->nki", x_nd, wg))
       * jnp.einsum("nd,nkdi->nki", x_nd, wu))
  y_nkd = jnp.einsum("nki,nkid->nkd", h, wd)
  y = jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(y_nkd.dtype))
  return y, _counts(ids_nk, e)
