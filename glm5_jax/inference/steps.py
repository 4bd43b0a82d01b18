"""The engine's device steps (pure functions; the Engine jits them).

Decode state `st` (a dict of arrays, one row per cache slot b):
    tok     int32 [b]  the pending token: sampled, not yet in the cache
    pos     int32 [b]  its position = number of cached rows
    active  bool  [b]  still generating
    n_gen   int32 [b]  tokens generated so far in this call
    budget  int32 [b]  max tokens for this call (max_new_tokens, capped by the cache)
    seed, req int32 [b];  temp, top_p f32 [b];  top_k int32 [b];  stop int32 [b, n_stop] (-1 pad)

MTP speculative round (spec §2.7; design.md decision 8; DeepSeek-V3 §2.2 and
vLLM's MTP proposer, chained EAGLE-style): the shared MTP layer keeps its own
latent cache. Its row j is computed from (token j + 1, the main model's
pre-norm hidden state at j), so with N rows in the main cache it is valid
through row N - 2, and `h_last` holds the main hidden state at row N - 1.
  1. draft 1: MTP row N - 1 from (pending token, h_last) -> q_1, d_1;
     draft k > 1: MTP row N + k - 2 from (d_{k-1}, MTP hidden of step k - 1) -> q_k, d_k.
  2. verify: one main forward over [pending, d_1 .. d_D] at rows N .. N + D.
  3. accept (sampling.speculative_accept) -> n drafts + one target token.
  4. MTP catch-up: rows N .. N + n - 1 recomputed from the verified hidden
     states, so the MTP cache again holds only main-model-derived rows.
Rows written for rejected drafts sit beyond the sequence length: they are
never visible (causal limit) and get overwritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.inference import forward
from glm5_jax.inference import sampling


def _stack_topk(all_idx):
  """[L, b, t, K] int32, or None for dense attention."""
  if any(i is None for i in all_idx):
    return None
  return jnp.stack(all_idx)


def prefill(cfg, form, with_mtp, params, cache, h_last, tokens_bt, start_b, n_valid_b):
  """One prefill chunk: rows start[b] .. start[b] + n_valid[b] - 1 get tokens[b, :n_valid[b]].

  Returns (cache, h_last, last_logits f32 [b, V] at each row's last valid
  token (garbage where n_valid == 0), top-k [L, b, t, K] or None).
  """
  s = cache["layers"][0]["kv"].shape[1]
  t = tokens_bt.shape[1]
  chunk = forward.make_chunk(start_b, n_valid_b, t, s)
  h0, normed, all_idx, layers = forward.model_forward(cfg, params, cache["layers"], tokens_bt,
                                                      chunk, form)
  last = jnp.maximum(n_valid_b - 1, 0)
  take = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  logits = forward.head(params, take(normed))
  cache = {**cache, "layers": layers}
  if with_mtp:
    # MTP rows start-1 .. start+n-2 from (tokens[i], h0 at row start-1+i).
    h_prev = jnp.concatenate([h_last[:, None].astype(h0.dtype), h0[:, :-1]], axis=1)
    mchunk = forward.make_chunk(start_b - 1, n_valid_b, t, s)
    _, _, cache["mtp"] = forward.mtp_forward(cfg, params, cache["mtp"], tokens_bt, h_prev,
                                             mchunk, form)
    h_last = jnp.where((n_valid_b > 0)[:, None], take(h0).astype(h_last.dtype), h_last)
  return cache, h_last, logits, _stack_topk(all_idx)


def _pick(logits_bv, st):
  """Sample the next token per row; returns (token [b], raw log-prob [b])."""
  logq = sampling.sampling_logprobs(logits_bv, st["temp"], st["top_k"], st["top_p"])
  keys = sampling.row_keys(st["seed"], st["req"], st["n_gen"])
  tok = sampling.sample(keys, logq)
  return tok, sampling.raw_logprobs(logits_bv, tok)


def _advance(st, tok_b, emit_b):
  """Account one emitted token per row where emit."""
  n_gen = st["n_gen"] + emit_b
  stop = jnp.any(tok_b[:, None] == st["stop"], axis=-1)
  active = st["active"] & ~(emit_b.astype(bool) & stop) & (n_gen < st["budget"])
  return {**st, "tok": jnp.where(emit_b > 0, tok_b, st["tok"]), "n_gen": n_gen, "active": active}


def first_token(logits_bv, st):
  """The token after the prompt. Returns (st, token [b], log-prob [b], emitted [b])."""
  tok, lp = _pick(logits_bv, st)
  emit = st["active"].astype(jnp.int32)
  return _advance(st, tok, emit), tok, lp, emit


def decode(cfg, form, n_steps, params, cache, st):
  """n_steps plain decode steps (lax.scan). Returns (cache, st, per-step outputs)."""
  s = cache["layers"][0]["kv"].shape[1]

  def step(carry, _):
    cache, st = carry
    emit = st["active"].astype(jnp.int32)
    chunk = forward.make_chunk(st["pos"], emit, 1, s)
    _, normed, all_idx, layers = forward.model_forward(cfg, params, cache["layers"],
                                                       st["tok"][:, None], chunk, form)
    tok, lp = _pick(forward.head(params, normed[:, 0]), st)
    topk = _stack_topk(all_idx)
    out = {"tok": tok, "logprob": lp, "emit": emit, "pos": st["pos"],
           "topk": None if topk is None else topk[:, :, 0]}
    st = _advance({**st, "pos": st["pos"] + emit}, tok, emit)
    return ({**cache, "layers": layers}, st), out

  (cache, st), outs = jax.lax.scan(step, (cache, st), None, length=n_steps)
  return cache, st, outs


def speculative_round(cfg, form, n_draft, params, cache, h_last, st):
  """One draft / verify / accept round (module docstring). Returns (cache, h_last, st, out)
  with out = {tok [b, D+1], logprob [b, D+1], n_emit [b], n_accepted [b], pos [b],
  topk [L, b, D+1, K] or None}; row b emitted tok[b, :n_emit[b]]."""
  s = cache["layers"][0]["kv"].shape[1]
  b, d = st["tok"].shape[0], n_draft
  act = st["active"].astype(jnp.int32)
  n0 = st["pos"]
  keys = sampling.row_keys(st["seed"], st["req"], st["n_gen"])
  keys = jax.vmap(lambda k: jax.random.split(k, d + 1))(keys)            # [b, D+1, key]
  rep = lambda x: jnp.repeat(x, d + 1, axis=0)

  # 1. Draft with the shared MTP module (one scanned step per draft).
  def draft(carry, k):
    mtp_cache, tok_b, h_bd = carry
    chunk = forward.make_chunk(n0 - 1 + k, act, 1, s)
    h, logits, mtp_cache = forward.mtp_forward(cfg, params, mtp_cache, tok_b[:, None],
                                               h_bd[:, None], chunk, form)
    logq = sampling.sampling_logprobs(logits[:, 0], st["temp"], st["top_k"], st["top_p"])
    tok_b = sampling.sample(keys[:, k], logq)
    return (mtp_cache, tok_b, h[:, 0].astype(h_bd.dtype)), (tok_b, logq)

  (mtp_cache, _, _), (drafts, logqs) = jax.lax.scan(
      draft, (cache["mtp"], st["tok"], h_last), jnp.arange(d))
  drafts_bd, logq_bdv = drafts.swapaxes(0, 1), logqs.swapaxes(0, 1)

  # 2. Verify with one main-model forward over D + 1 tokens.
  vtok = jnp.concatenate([st["tok"][:, None], drafts_bd], axis=1)
  chunk = forward.make_chunk(n0, act * (d + 1), d + 1, s)
  h0, normed, all_idx, layers = forward.model_forward(cfg, params, cache["layers"], vtok,
                                                      chunk, form)
  logits = forward.head(params, normed)                                  # [b, D+1, V]
  v = logits.shape[-1]
  logp = sampling.sampling_logprobs(logits.reshape(b * (d + 1), v), rep(st["temp"]),
                                    rep(st["top_k"]), rep(st["top_p"])).reshape(b, d + 1, v)

  # 3. Accept, then cut at a stop token or the budget.
  n_acc, y = sampling.speculative_accept(keys[:, d], drafts_bd, logq_bdv, logp)
  i_t = jnp.arange(d + 1)[None, :]
  out_tok = jnp.where(i_t < n_acc[:, None], jnp.pad(drafts_bd, ((0, 0), (0, 1))), y[:, None])
  out_lp = sampling.raw_logprobs(logits, out_tok)
  is_stop = jnp.any(out_tok[..., None] == st["stop"][:, None, :], axis=-1) & (i_t <= n_acc[:, None])
  has_stop = jnp.any(is_stop, -1)
  first_stop = jnp.where(has_stop, jnp.argmax(is_stop, -1) + 1, d + 1)
  n_emit = jnp.minimum(jnp.minimum(n_acc + 1, st["budget"] - st["n_gen"]), first_stop) * act

  # 4. MTP catch-up over the accepted drafts (rows N .. N + n - 1).
  chunk = forward.make_chunk(n0, n_acc * act, d, s)
  _, _, mtp_cache = forward.mtp_forward(cfg, params, mtp_cache, drafts_bd, h0[:, :d], chunk, form)

  last = jnp.maximum(n_emit - 1, 0)[:, None]
  h_sel = jnp.take_along_axis(h0, last[:, :, None], axis=1)[:, 0]
  h_last = jnp.where((n_emit > 0)[:, None], h_sel.astype(h_last.dtype), h_last)
  n_gen = st["n_gen"] + n_emit
  stopped = has_stop & (first_stop <= n_emit) & (n_emit > 0)
  st = {**st, "tok": jnp.where(n_emit > 0, jnp.take_along_axis(out_tok, last, 1)[:, 0], st["tok"]),
        "pos": n0 + n_emit, "n_gen": n_gen,
        "active": st["active"] & ~stopped & (n_gen < st["budget"])}
  cache = {"layers": layers, "mtp": mtp_cache}
  out = {"tok": out_tok, "logprob": out_lp, "n_emit": n_emit, "n_accepted": n_acc * act,
         "pos": n0, "topk": _stack_topk(all_idx)}
  return cache, h_last, st, out
