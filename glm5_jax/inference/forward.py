"""Cached GLM-5 forward pass for inference: a chunk of new tokens per sequence.

The trainer's modules (glm5_jax.nn) run a whole sequence at once. Here each
of b sequences brings t new tokens at its own positions `start[b] + i` and
attends to its cached rows plus the new ones; `n_valid[b] <= t` of them are
real, the rest are padding that is never written to the cache and never
selected by a real query. One function serves chunked prefill (t = a bucket),
decode (t = 1) and speculative verification (t = D + 1).

Per layer the cache holds, per token, only (spec §2.3, §2.4)
    kv    [c + p]  the MLA latent c_kv and the rope key k_rope, one shared row
    k_idx [d_i]    the lightning-indexer key (float32, as the trainer computes it)
and nothing per head. Attention is the absorbed (MQA) form of spec §2.3 over
the top-k rows that the indexer selects among the cached keys (spec §2.4),
using the same pure functions as the trainer: `absorb_query`,
`pallas_kernels.sparse_attention.sparse_mla`, `index_scores` and
`deterministic_topk` (ties -> lower position), the Indexer / MoE / MLP modules
applied to their parameter subtrees, `rms_norm`, `rope_angles`, `apply_rope`.
The "expanded" form (per-head K/V up-projected from the gathered latent rows,
spec §2.2) gives the same numbers and exists for benchmarks.

Notation: b batch (cache slots), t new tokens, S cache length, h heads,
c kv_lora, p qk_rope, n qk_nope, d_i indexer head dim, K index_topk, d hidden.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.nn import dsa_kernels
from glm5_jax.nn import indexer as indexer_lib
from glm5_jax.nn import layer_stack
from glm5_jax.nn import mla as mla_lib
from glm5_jax.nn import moe as moe_lib
from glm5_jax.nn import norms
from glm5_jax.nn import rope
from pallas_kernels.lightning_indexer import reference as indexer_ref

ATTENTION_FORMS = ("absorbed", "expanded")


class Chunk(NamedTuple):
  """Where a chunk of t tokens per sequence goes.

  qpos_bt: int32 [b, t] absolute positions start[b] + i (RoPE, causal limit).
  write_bt: int32 [b, t] cache rows to write; S (out of range: dropped) for
    padding tokens.
  """
  qpos_bt: Any
  write_bt: Any


def make_chunk(start_b, n_valid_b, t: int, cache_len: int, first_valid_b=None) -> Chunk:
  """Chunk for tokens at positions start[b] .. start[b] + t - 1, n_valid[b] of them real.

  first_valid_b: optional int32 [b]; tokens before it are not written either
  (the MTP prefill row at position -1).
  """
  i_t = jnp.arange(t, dtype=jnp.int32)
  qpos = start_b[:, None].astype(jnp.int32) + i_t[None, :]
  ok = i_t[None, :] < n_valid_b[:, None]
  if first_valid_b is not None:
    ok &= i_t[None, :] >= first_valid_b[:, None]
  ok &= (qpos >= 0) & (qpos < cache_len)
  return Chunk(qpos, jnp.where(ok, qpos, cache_len))


def init_layer_cache(cfg, batch: int, max_len: int, has_indexer: bool):
  """Zeros {'kv': [b, S, c + p] dtype, 'k_idx': [b, S, d_i] f32 or None}."""
  dt = jnp.dtype(cfg.dtype)
  return {"kv": jnp.zeros((batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dt),
          "k_idx": (jnp.zeros((batch, max_len, cfg.index_head_dim), jnp.float32)
                    if has_indexer else None)}


def _write(cache_bsx, rows_btx, write_bt):
  """cache[b, write[b, i]] = rows[b, i]; rows with write == S are dropped."""
  b_idx = jnp.arange(cache_bsx.shape[0])[:, None]
  return cache_bsx.at[b_idx, write_bt].set(rows_btx.astype(cache_bsx.dtype), mode="drop")


def select_topk(cfg, q_btjd, w_btj, k_idx_bsd, qpos_bt):
  """Deterministic top-k over the cached indexer keys, per-sequence causal limit.

  Same scores (`index_scores`) and the same selection rule
  (`deterministic_topk`: descending, ties -> lower position, -1 fill) as the
  trainer's `topk_indices`; keys beyond a query's position are never visible,
  so stale or padded cache rows cannot be chosen. Queries are processed in
  chunks of `attention_chunk_size` (peak memory O(b * chunk * S)).

  Returns int32 [b, t, K].
  """
  b, t = qpos_bt.shape
  c = max(1, min(cfg.attention_chunk_size, t))
  n = -(-t // c)
  pad = n * c - t
  padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  q_c = padt(q_btjd).reshape(b, n, c, *q_btjd.shape[2:]).swapaxes(0, 1)
  w_c = padt(w_btj).reshape(b, n, c, w_btj.shape[-1]).swapaxes(0, 1)
  l_c = padt(qpos_bt).reshape(b, n, c).swapaxes(0, 1)

  def one_chunk(args):
    q, w, limit_bc = args
    scores_bcs = indexer_ref.index_scores(q, k_idx_bsd, w)
    one_row = lambda s_cs, l_c: indexer_ref.deterministic_topk(s_cs[None], l_c, cfg.index_topk)[0]
    return jax.vmap(one_row)(scores_bcs, limit_bc)

  idx = jax.lax.map(one_chunk, (q_c, w_c, l_c))                  # [n, b, c, K]
  return idx.swapaxes(0, 1).reshape(b, n * c, -1)[:, :t]


def expanded_sparse_attention(cfg, q_nope, q_rope, kv_bsx, w_uk, w_uv, indices_btk):
  """Expanded (MHA) form over the gathered top-k latent rows: o [b, t, h, v].

  k_nope = c_kv W_UK and v = c_kv W_UV per head for each selected row
  (spec §2.2); equal to the absorbed form in exact arithmetic.
  """
  c = cfg.kv_lora_rank
  rows = jax.vmap(lambda kv, i: kv[jnp.maximum(i, 0)])(kv_bsx, indices_btk)   # [b, t, K, c+p]
  k_nope = jnp.einsum("btkc,chn->btkhn", rows[..., :c], w_uk)
  v = jnp.einsum("btkc,chv->btkhv", rows[..., :c], w_uv)
  f32 = jnp.promote_types(q_nope.dtype, jnp.float32)
  logits = (jnp.einsum("bthn,btkhn->bthk", q_nope, k_nope, preferred_element_type=f32)
            + jnp.einsum("bthp,btkp->bthk", q_rope, rows[..., c:],
                         preferred_element_type=f32)) * cfg.softmax_scale
  valid = (indices_btk >= 0)[:, :, None, :]
  logits = jnp.where(valid, logits, -jnp.inf)
  probs = jnp.where(jnp.any(valid, -1, keepdims=True), jax.nn.softmax(logits, axis=-1), 0.0)
  return jnp.einsum("bthk,btkhv->bthv", probs.astype(v.dtype), v)


def attention(cfg, p, x_btd, cos, sin, cache, chunk: Chunk, prev_idx, form: str):
  """MLA + DSA of one layer over its cache. Returns (out [b,t,d], top-k or None, cache).

  Mirrors glm5_jax.nn.mla.MLA (same casts, same eps 1e-6 latent norms).
  """
  dt = jnp.dtype(cfg.dtype)
  n, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  x = x_btd.astype(dt)
  c_q = norms.rms_norm(x @ p["wq_a"].astype(dt), p["q_norm"]["scale"], 1e-6).astype(dt)
  q = jnp.einsum("btr,rhk->bthk", c_q, p["wq_b"].astype(dt))
  q_nope = q[..., :n]
  q_rope = rope.apply_rope(q[..., n:], cos, sin, interleave=cfg.rope_interleave)
  ckv = x @ p["wkv_a"].astype(dt)
  c_kv = norms.rms_norm(ckv[..., :c], p["kv_norm"]["scale"], 1e-6).astype(dt)
  k_rope = rope.apply_rope(ckv[..., c:], cos, sin, interleave=cfg.rope_interleave)
  kv = _write(cache["kv"], jnp.concatenate([c_kv, k_rope.astype(dt)], -1), chunk.write_bt)
  new_cache = {"kv": kv, "k_idx": cache["k_idx"]}
  w_uk, w_uv = p["w_uk"].astype(dt), p["w_uv"].astype(dt)

  indices = prev_idx
  if "indexer" in p:
    q_i, k_i, w_i = indexer_lib.Indexer(cfg).apply({"params": p["indexer"]}, x_btd, c_q, cos, sin)
    new_cache["k_idx"] = _write(cache["k_idx"], k_i, chunk.write_bt)
    if cfg.attention_type == "sparse":
      indices = select_topk(cfg, q_i, w_i, new_cache["k_idx"], chunk.qpos_bt)

  if cfg.attention_type == "dense":
    s = kv.shape[1]
    mask_bts = jnp.arange(s)[None, None, :] <= chunk.qpos_bt[:, :, None]
    o = mla_lib.mla_absorbed_attention(q_nope, q_rope, kv[..., :c], kv[..., c:], w_uk, w_uv,
                                       mask_bts, cfg.softmax_scale)
  elif form == "absorbed":
    u, _ = dsa_kernels.sparse_mla(
        mla_lib.absorb_query(q_nope, q_rope, w_uk), kv, indices, v_dim=c,
        scale=cfg.softmax_scale, impl=cfg.attention_impl,
        interpret=None, chunk_size=cfg.attention_chunk_size)
    o = jnp.einsum("bthc,chv->bthv", u, w_uv)
  elif form == "expanded":
    o = expanded_sparse_attention(cfg, q_nope, q_rope, kv, w_uk, w_uv, indices)
  else:
    raise ValueError(f"attention form={form!r}: expected one of {ATTENTION_FORMS}")
  out = jnp.einsum("bthv,hvd->btd", o, p["wo"].astype(dt))
  return out, indices, new_cache


def decoder_layer(cfg, p, h_btd, cos, sin, cache, chunk: Chunk, prev_idx, moe: bool, form: str):
  """One pre-norm layer (glm5_jax.nn.decoder). Returns (h, top-k or None, cache)."""
  eps = cfg.rms_norm_eps
  x = norms.rms_norm(h_btd, p["input_norm"]["scale"], eps).astype(h_btd.dtype)
  attn, idx, cache = attention(cfg, p["attn"], x, cos, sin, cache, chunk, prev_idx, form)
  h_btd = h_btd + attn.astype(h_btd.dtype)
  x = norms.rms_norm(h_btd, p["post_attention_norm"]["scale"], eps).astype(h_btd.dtype)
  if moe:
    y = moe_ffn(cfg, p["moe"], x)
  else:
    y = moe_lib.MLP(cfg, cfg.intermediate_size).apply({"params": p["mlp"]}, x)
  return h_btd + y.astype(h_btd.dtype), idx, cache


def moe_ffn(cfg, p, x_btd):
  """The MoE FFN (glm5_jax.nn.moe): `route`, routed experts, shared expert.

  Chunks with fewer (token, expert) pairs than experts (decode) gather each
  token's K expert matrices and run them as batched matmuls, which reads less
  weight memory than the dropless grouped path and avoids `ragged_dot`'s slow
  CPU lowering; larger chunks (prefill) run the trainer's MoE module itself.
  Same routing, same math; only the summation order of the K experts differs.
  """
  b, t, d = x_btd.shape
  if b * t * cfg.num_experts_per_tok >= cfg.n_routed_experts:
    return moe_lib.MoE(cfg).apply({"params": p}, x_btd)[0]
  dt = jnp.dtype(cfg.dtype)
  x = x_btd.reshape(b * t, d)
  ids_nk, weights_nk = moe_lib.route(cfg, x, p["router"]["kernel"],
                                     p["router"]["e_score_correction_bias"])
  w = {k: v[ids_nk].astype(dt) for k, v in p["experts"].items()}       # [n, K, ...]
  xd = x.astype(dt)
  h_nki = (jax.nn.silu(jnp.einsum("nd,nkdi->nki", xd, w["w_gate"]))
           * jnp.einsum("nd,nkdi->nki", xd, w["w_up"]))
  y_nkd = jnp.einsum("nki,nkid->nkd", h_nki, w["w_down"])
  y = jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(y_nkd.dtype)).reshape(b, t, d)
  if cfg.n_shared_experts:
    y = y + moe_lib.MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts).apply(
        {"params": p["shared"]}, x_btd)
  return y


def embed(cfg, params, tokens_bt):
  return jnp.take(params["embed"]["embedding"], tokens_bt, axis=0).astype(cfg.dtype)


def head(params, normed_btd):
  """float32 logits [.., V] (glm5_jax.nn.model.Head)."""
  kernel = params["lm_head"]["kernel"]
  return jnp.einsum("...d,dv->...v", normed_btd, kernel.astype(normed_btd.dtype),
                    preferred_element_type=jnp.float32)


def _angles(cfg, qpos_bt):
  return rope.rope_angles(qpos_bt, cfg.qk_rope_head_dim, cfg.rope_theta)


def model_forward(cfg, params, layer_caches, tokens_bt, chunk: Chunk, form: str = "absorbed"):
  """Main model over a chunk. Returns (h_final pre-norm [b,t,d], final-normed hidden
  [b,t,d] (apply `head` where logits are needed), per-layer top-k list, new caches)."""
  cos, sin = _angles(cfg, chunk.qpos_bt)
  h = embed(cfg, params, tokens_bt)
  new_caches, all_idx, idx = [], [], None
  for i in range(cfg.num_hidden_layers):
    h, layer_idx, cache = decoder_layer(cfg, layer_stack.layer_params(cfg, params, i), h, cos,
                                        sin, layer_caches[i], chunk, idx, cfg.is_moe_layer(i),
                                        form)
    idx = layer_idx
    all_idx.append(layer_idx)
    new_caches.append(cache)
  normed = norms.rms_norm(h, params["final_norm"]["scale"], cfg.rms_norm_eps).astype(h.dtype)
  return h, normed, all_idx, new_caches


def mtp_forward(cfg, params, mtp_cache, next_tokens_bt, h_prev_btd, chunk: Chunk,
                form: str = "absorbed"):
  """The shared MTP module (glm5_jax.nn.mtp.MTPStep) over a chunk with its own cache.

  Row i combines the embedding of the token AFTER position qpos[i] with the
  hidden state h_prev at qpos[i] (embedding first, spec §2.7). Returns
  (h [b,t,d] pre head-norm, logits f32 [b,t,V], new cache).
  """
  p, eps = params["mtp"], cfg.rms_norm_eps
  cos, sin = _angles(cfg, chunk.qpos_bt)
  emb = embed(cfg, params, next_tokens_bt)
  e = norms.rms_norm(emb, p["enorm"]["scale"], eps).astype(emb.dtype)
  hh = norms.rms_norm(h_prev_btd, p["hnorm"]["scale"], eps).astype(h_prev_btd.dtype)
  x = jnp.concatenate([e, hh], axis=-1) @ p["eh_proj"].astype(e.dtype)
  h, _, cache = decoder_layer(cfg, p["layer"], x, cos, sin, mtp_cache, chunk, None,
                              cfg.is_moe_layer(cfg.num_hidden_layers), form)
  normed = norms.rms_norm(h, p["head_norm"]["scale"], eps).astype(h.dtype)
  return h, head(params, normed), cache


def kv_bytes_per_token(cfg, with_mtp: bool = False) -> dict[str, int]:
  """Cache bytes per token: the latent cache here vs a per-head expanded K/V cache."""
  layers = cfg.num_hidden_layers + (1 if with_mtp and cfg.num_nextn_predict_layers else 0)
  dsize = jnp.dtype(cfg.dtype).itemsize
  n_idx = sum(cfg.indexer_type(i) == "full" for i in range(cfg.num_hidden_layers))
  n_idx += layers - cfg.num_hidden_layers
  idx_bytes = n_idx * cfg.index_head_dim * 4                        # float32 indexer keys
  latent = layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dsize + idx_bytes
  per_head = layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * dsize
  return {"latent": int(latent), "expanded_per_head": int(per_head + idx_bytes)}
