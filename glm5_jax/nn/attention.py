"""Memory-bounded dense attention: blockwise online softmax in XLA, splash attention on TPU.

Notation: b batch, t queries, s keys, h heads, d query/key head dim, e value head dim.

Which keys a query sees is given per query as an interval of key positions,
`start[b, i] <= j <= limit[b, i]` (int32 [b, t] each), not by assuming that
query i sits at key i:
  limit  last visible key: causal `s - t + i` by default (`causal_limit`), so a
         block of t queries may sit at the end of s keys (chunked prefill) or,
         under context parallelism, anywhere in the sequence;
  start  first visible key: the query's document start for packed rows
         (`layer_io.document_starts`), 0 by default.
A query with start > limit sees nothing and gets a zero output.

`flash_attention` is the XLA path (every backend): FlashAttention-2 (Dao, 2023,
arXiv 2307.08691, Algorithms 1 and 2) written with `lax` loops. Queries go in
blocks of `block_q`, keys in blocks of `block_k`; the forward pass keeps a running
max m, normaliser l and output accumulator per query row, and saves only the
output and the row logsumexp. The backward pass (`jax.custom_vjp`) recomputes each
[block_q, block_k] tile's probabilities from the saved logsumexp and accumulates
dq per query block and dk, dv per key block. Nothing of size t * s exists, so
memory is linear in the sequence length at fixed block sizes. A query block only
visits the key blocks between its smallest start and its largest limit (causal:
half the tiles are skipped).

Keys and values come either one head per query head (`[b, s, h, d]`, MHA) or as one
head that all query heads share (`[b, s, d]`, MQA). MLA's absorbed form is the second:
queries `[q_nope W_UK^T | q_rope]` against the latent rows `[c_kv | k_rope]`, values
`c_kv` (nn/mla.py), so per-head keys and values are never built. With s keys and h heads
that keeps O(s * h * (d + e)) of keys, values and their gradients out of memory, at the
price of wider dot products (MLA's latent width instead of its head dims).

`splash_attention` is jax's Pallas splash attention kernel for TPU
(`jax.experimental.pallas.ops.tpu.splash_attention`): a causal mask plus segment
ids, here the document starts (key j is in query i's document iff
start[j] == start[i], given causality and contiguous documents). It takes any
head dims (a v5e compile at MLA's d = 192, e = 256 needs no padding; see
docs/long_context.md). `dense_attention` picks the path; see its docstring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from glm5_jax import sharding as shd
from glm5_jax.padding import add_rows, pad_to_multiple, rows, set_rows

IMPLS = ("xla", "pallas")
_SPLASH_BLOCK = 512        # splash tile (a multiple of 128 lanes)
_SPLASH_LANES = 128


# --------------------------------------------------------------------------------------
# Visibility
# --------------------------------------------------------------------------------------

def causal_limit(b: int, t: int, s: int):
  """[b, t] int32: query i of the last t of s positions sees keys j <= s - t + i."""
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (s - t), (b, t))


def visible_range(b: int, t: int, s: int, start_bt=None, limit_bt=None):
  """(start, limit) [b, t] int32 with the defaults filled in (0 and `causal_limit`)."""
  start = jnp.zeros((b, t), jnp.int32) if start_bt is None else start_bt.astype(jnp.int32)
  limit = causal_limit(b, t, s) if limit_bt is None else limit_bt.astype(jnp.int32)
  return start, limit


def visibility_mask(start_bt, limit_bt, s: int):
  """[b, t, s] bool: start[b, i] <= j <= limit[b, i] (for references and tests)."""
  pos = jnp.arange(s, dtype=jnp.int32)
  return (pos >= start_bt[..., None]) & (pos <= limit_bt[..., None])


# --------------------------------------------------------------------------------------
# XLA path: blockwise online softmax with a recomputing backward pass
# --------------------------------------------------------------------------------------

def _key_block_range(start_bq, limit_bq, block_k: int):
  """(first, end) key blocks one query block must visit: those between its smallest start
  and its largest limit. Rows that see nothing (start > limit; padding) do not count."""
  seen = start_bq <= limit_bq
  lo = jnp.min(jnp.where(seen, start_bq, jnp.iinfo(jnp.int32).max))
  hi = jnp.max(jnp.where(seen, limit_bq, -1))
  return jnp.where(hi >= 0, lo // block_k, 0), jnp.where(hi >= 0, hi // block_k + 1, 0)


def _tile_mask(start_bq, limit_bq, j, block_k: int):
  """[b, 1, block_q, block_k] bool: which keys of key block j each query row sees."""
  pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
  return ((pos >= start_bq[..., None]) & (pos <= limit_bq[..., None]))[:, None]


def _tiles(q, k, v, start, limit, block_q: int, block_k: int):
  """(q, k, v padded to whole blocks, start, limit clipped to [0, s - 1], block_q, block_k)."""
  t, s = q.shape[1], k.shape[1]
  bq, bk = max(1, min(block_q, t)), max(1, min(block_k, s))
  start = pad_to_multiple(jnp.maximum(start, 0), bq)
  limit = pad_to_multiple(jnp.minimum(limit, s - 1), bq, value=-1)   # padding rows see nothing
  return (pad_to_multiple(q, bq), pad_to_multiple(k, bk), pad_to_multiple(v, bk), start, limit,
          bq, bk)


def _kv_subscripts(k):
  """einsum subscripts of a key / value block: one head per query head, or one shared."""
  return ("bkhd", "bkhe") if k.ndim == 4 else ("bkd", "bke")


def _acc_dtype(q):
  return jnp.promote_types(q.dtype, jnp.float32)        # float64 stays float64 in tests


def _forward(q, k, v, start, limit, scale, block_q, block_k):
  """(o [b, t, h, e], lse [b, h, t_padded]) by the online softmax."""
  b, t, h, _ = q.shape
  acc_t = _acc_dtype(q)
  qp, kp, vp, st, li, bq, bk = _tiles(q, k, v, start, limit, block_q, block_k)
  e = v.shape[-1]
  ks, vs = _kv_subscripts(k)

  def query_block(i, bufs):
    q_i, st_i, li_i = rows(qp, i, bq), rows(st, i, bq), rows(li, i, bq)

    def key_block(j, carry):
      m, l, acc = carry
      logits = jnp.einsum(f"bqhd,{ks}->bhqk", q_i, rows(kp, j, bk),
                          preferred_element_type=acc_t) * scale
      logits = jnp.where(_tile_mask(st_i, li_i, j, bk), logits, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
      m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)   # rows with nothing seen yet
      p = jnp.exp(logits - m_use[..., None])
      alpha = jnp.exp(m - m_use)
      pv = jnp.einsum(f"bhqk,{vs}->bhqe", p.astype(vp.dtype), rows(vp, j, bk),
                      preferred_element_type=acc_t)
      return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    init = (jnp.full((b, h, bq), -jnp.inf, acc_t), jnp.zeros((b, h, bq), acc_t),
            jnp.zeros((b, h, bq, e), acc_t))
    m, l, acc = jax.lax.fori_loop(*_key_block_range(st_i, li_i, bk), key_block, init)
    seen = l > 0
    o = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    o_buf, lse_buf = bufs
    return (set_rows(o_buf, i, bq, o.transpose(0, 2, 1, 3)),
            set_rows(lse_buf, i, bq, lse, axis=2))

  n = qp.shape[1]
  o, lse = jax.lax.fori_loop(0, n // bq, query_block,
                             (jnp.zeros((b, n, h, e), v.dtype), jnp.zeros((b, h, n), acc_t)))
  return o[:, :t], lse


def _backward(q, k, v, start, limit, o, lse, do, scale, block_q, block_k):
  """(dq, dk, dv): FlashAttention-2 Algorithm 2, dk / dv accumulated over query blocks."""
  t, s = q.shape[1], k.shape[1]
  acc_t = _acc_dtype(q)
  qp, kp, vp, st, li, bq, bk = _tiles(q, k, v, start, limit, block_q, block_k)
  do_p, o_p = pad_to_multiple(do.astype(o.dtype), bq), pad_to_multiple(o, bq)
  ks, vs = _kv_subscripts(k)

  def query_block(i, bufs):
    q_i, do_i, lse_i = rows(qp, i, bq), rows(do_p, i, bq), rows(lse, i, bq, axis=2)
    st_i, li_i = rows(st, i, bq), rows(li, i, bq)
    delta = jnp.einsum("bqhe,bqhe->bhq", rows(o_p, i, bq), do_i, preferred_element_type=acc_t)

    def key_block(j, carry):
      dq_i, dk, dv = carry
      k_j, v_j = rows(kp, j, bk), rows(vp, j, bk)
      logits = jnp.einsum(f"bqhd,{ks}->bhqk", q_i, k_j, preferred_element_type=acc_t) * scale
      p = jnp.where(_tile_mask(st_i, li_i, j, bk), jnp.exp(logits - lse_i[..., None]), 0.0)
      dv_j = jnp.einsum(f"bhqk,bqhe->{vs}", p.astype(do_i.dtype), do_i,
                        preferred_element_type=acc_t)
      dp = jnp.einsum(f"bqhe,{vs}->bhqk", do_i, v_j, preferred_element_type=acc_t)
      ds = (p * (dp - delta[..., None]) * scale).astype(q_i.dtype)
      dq_i = dq_i + jnp.einsum(f"bhqk,{ks}->bqhd", ds, k_j, preferred_element_type=acc_t)
      dk_j = jnp.einsum(f"bhqk,bqhd->{ks}", ds, q_i, preferred_element_type=acc_t)
      return dq_i, add_rows(dk, j, bk, dk_j), add_rows(dv, j, bk, dv_j)

    dq, dk, dv = bufs
    dq_i, dk, dv = jax.lax.fori_loop(*_key_block_range(st_i, li_i, bk), key_block,
                                     (jnp.zeros(q_i.shape, acc_t), dk, dv))
    return set_rows(dq, i, bq, dq_i), dk, dv

  zeros = lambda a, dt: jnp.zeros(a.shape, dt)
  dq, dk, dv = jax.lax.fori_loop(0, qp.shape[1] // bq, query_block,
                                 (zeros(qp, q.dtype), zeros(kp, acc_t), zeros(vp, acc_t)))
  return dq[:, :t], dk[:, :s].astype(k.dtype), dv[:, :s].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, start, limit, scale, block_q, block_k):
  return _forward(q, k, v, start, limit, scale, block_q, block_k)[0]


def _flash_fwd(q, k, v, start, limit, scale, block_q, block_k):
  o, lse = _forward(q, k, v, start, limit, scale, block_q, block_k)
  return o, (q, k, v, start, limit, o, lse)


def _flash_bwd(scale, block_q, block_k, res, do):
  q, k, v, start, limit, o, lse = res
  dq, dk, dv = _backward(q, k, v, start, limit, o, lse, do, scale, block_q, block_k)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_bthd, k_bshd, v_bshe, *, scale: float, start_bt=None, limit_bt=None,
                    block_q: int = 512, block_k: int = 512):
  """Blockwise exact attention in XLA. Returns o [b, t, h, e] in v's dtype.

  Args:
    q_bthd, k_bshd, v_bshe: queries [b, t, h, d]; keys [b, s, h, d] and values
      [b, s, h, e] (one head per query head), or keys [b, s, d] and values [b, s, e]
      (one head shared by all query heads: MQA; module docstring).
    scale: logit scale.
    start_bt, limit_bt: int32 [b, t] visible key interval per query (module docstring);
      default 0 and `causal_limit`.
    block_q, block_k: query / key tile; peak temporaries O(b * h * block_q * block_k)
      besides the inputs, outputs and gradients: O((t + s) * h * (d + e)), or
      O(t * h * (d + e) + s * (d + e)) with shared keys and values.

  Logits and softmax statistics are float32 (float64 for float64 inputs); the
  probabilities meet v in v's dtype, as in `mla.mla_expanded_attention`.
  """
  b, t = q_bthd.shape[:2]
  start, limit = visible_range(b, t, k_bshd.shape[1], start_bt, limit_bt)
  return _flash(q_bthd, k_bshd, v_bshe, start, limit, float(scale), int(block_q), int(block_k))


# --------------------------------------------------------------------------------------
# TPU path: jax's Pallas splash attention
# --------------------------------------------------------------------------------------

def splash_attention(q_bthd, k_bshd, v_bshe, *, scale: float, doc_start_bt=None,
                     interpret: bool = False):
  """Causal self-attention (t == s) by the splash kernel; packed documents via segment ids.

  Args:
    q_bthd, k_bshd, v_bshe: as in `flash_attention`, with t == s.
    scale: logit scale (folded into q: splash applies none).
    doc_start_bt: optional int32 [b, t] document start of each position
      (`layer_io.document_starts`); it serves as the segment id of the query and of the key.
    interpret: run the kernel in Pallas interpret mode (CPU tests).
  """
  b, t, h, _ = q_bthd.shape
  if k_bshd.shape[1] != t:
    raise ValueError(f"splash_attention: causal self-attention needs t == s; got t={t}, "
                     f"s={k_bshd.shape[1]}")
  blk = min(_SPLASH_BLOCK, -(-t // _SPLASH_LANES) * _SPLASH_LANES)
  n = -(-t // blk) * blk
  seg = jnp.zeros((b, t), jnp.int32) if doc_start_bt is None else doc_start_bt.astype(jnp.int32)
  seg = jnp.pad(seg, ((0, 0), (0, n - t)), constant_values=-1)    # padding: its own segment
  pad = lambda x: jnp.pad(x, ((0, 0), (0, n - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  q = pad((q_bthd * jnp.asarray(scale, q_bthd.dtype)).astype(q_bthd.dtype))
  k, v = pad(k_bshd), pad(v_bshe)
  sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                            block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                            block_q_dq=blk, block_kv_dq=blk)
  mask = splash.MultiHeadMask([splash.CausalMask((n, n))] * h)
  kernel = splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)
  o = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
      q, k, v, seg)
  return o.transpose(0, 2, 1, 3)[:, :t]


# --------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------

def dense_attention(q_bthd, k_bshd, v_bshe, *, scale: float, start_bt=None, limit_bt=None,
                    impl: str = "xla", block_q: int = 512, block_k: int = 512,
                    interpret: bool | None = None):
  """Dense (all visible keys) attention, memory linear in the sequence length.

  impl="xla": `flash_attention` on every backend.
  impl="pallas": splash attention for causal self-attention (t == s, limit_bt None,
    start_bt the document starts or None); with interpret=None the lowering platform
    picks: the splash kernel on TPU, `flash_attention` elsewhere (GPU: cuDNN through
    `jax.nn.dot_product_attention` has no packed-document mask short of a dense
    [b, h, t, s] bias, and wants e == d; docs/long_context.md). interpret=True runs the
    splash kernel in Pallas interpret mode on any backend.
  """
  flash = functools.partial(flash_attention, scale=scale, start_bt=start_bt,
                            limit_bt=limit_bt, block_q=block_q, block_k=block_k)
  if impl == "xla":
    return flash(q_bthd, k_bshd, v_bshe)
  if impl != "pallas":
    raise ValueError(f"dense_attention: impl={impl!r}, expected one of {IMPLS}")
  if k_bshd.ndim != 4:
    raise ValueError(f"dense_attention: impl='pallas' (splash) takes one key / value head "
                     f"per query head, keys [b, s, h, d]; got keys of shape {k_bshd.shape} "
                     "(shared keys: use impl='xla')")
  if limit_bt is not None or q_bthd.shape[1] != k_bshd.shape[1]:
    raise ValueError("dense_attention: impl='pallas' (splash) is causal self-attention: "
                     f"expected limit_bt=None and t == s, got limit_bt "
                     f"{'given' if limit_bt is not None else 'None'}, t={q_bthd.shape[1]}, "
                     f"s={k_bshd.shape[1]}; use impl='xla'")
  start = jnp.zeros(q_bthd.shape[:2], jnp.int32) if start_bt is None else start_bt
  if interpret:
    return _per_shard(splash_attention, scale, True, q_bthd, k_bshd, v_bshe, start)
  kernel = lambda q, k, v: _per_shard(splash_attention, scale, False, q, k, v, start)
  return jax.lax.platform_dependent(q_bthd, k_bshd, v_bshe, tpu=kernel, default=flash)


def _per_shard(kernel, scale, interpret, q, k, v, doc_start):
  """`kernel` inside `jax.shard_map` when a mesh is set (XLA cannot partition a Pallas
  call): batch over the batch axes, heads over `tensor`, as in nn/dsa.py."""
  call = lambda q, k, v, ds: kernel(q, k, v, scale=scale, doc_start_bt=ds, interpret=interpret)
  mesh = shd.active_mesh()
  if mesh is None:
    return call(q, k, v, doc_start)
  bat = shd.axes_dividing(mesh, shd.BATCH_AXES, q.shape[0])
  spec = P(bat, None, shd.axes_dividing(mesh, (shd.TENSOR_AXIS,), q.shape[2]))
  return jax.shard_map(call, in_specs=(spec, spec, spec, P(bat)), out_specs=spec,
                       check_vma=False)(q, k, v, doc_start)


def reference_attention(q_bthd, k_bshd, v_bshe, *, scale: float, start_bt=None,
                        limit_bt=None):
  """The unblocked [b, h, t, s] computation `flash_attention` must equal (tests)."""
  b, t, h = q_bthd.shape[:3]
  s = k_bshd.shape[1]
  if k_bshd.ndim == 3:                                  # one shared head: give every query head it
    k_bshd = jnp.broadcast_to(k_bshd[:, :, None], (b, s, h, k_bshd.shape[-1]))
    v_bshe = jnp.broadcast_to(v_bshe[:, :, None], (b, s, h, v_bshe.shape[-1]))
  start, limit = visible_range(b, t, s, start_bt, limit_bt)
  acc_t = _acc_dtype(q_bthd)
  logits = jnp.einsum("bthd,bshd->bhts", q_bthd, k_bshd, preferred_element_type=acc_t) * scale
  mask = visibility_mask(start, limit, s)[:, None]
  row_seen = jnp.any(mask, axis=-1, keepdims=True)
  logits = jnp.where(mask, logits, jnp.where(row_seen, -jnp.inf, 0.0))   # no NaN, no NaN grads
  probs = jnp.where(row_seen, jax.nn.softmax(logits, axis=-1), 0.0)
  return jnp.einsum("bhts,bshe->bthe", probs.astype(v_bshe.dtype), v_bshe)

