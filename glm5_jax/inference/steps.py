"""The engine's device steps: pure functions over the trainer's own model, and their jitted
form (`jit_steps`).

Every step runs `GLM5(cfg).apply(..., cache=, cache_index=)` (nn/model.py), the forward
pass the trainer differentiates, over the paged KV pool (nn/kv_cache.py); nothing here
re-implements a layer. A step sees all `max_batch` slots; each slot brings its block
table (int32 [b, m], pool blocks of logical blocks 0 .. m-1, `num_blocks` = not held) and
rows with n_valid = 0 are inert (nothing written, outputs ignored).

Decode state `st` (a dict of arrays, one row per slot b):
    tok     int32 [b]  the pending token: sampled, not yet in the cache
    pos     int32 [b]  its position = number of cached rows
    active  bool  [b]  still generating
    n_gen   int32 [b]  tokens generated so far by this request
    budget  int32 [b]  max tokens for this request (max_new_tokens, capped by the cache)
    seed, req int32 [b];  temp, top_p f32 [b];  top_k int32 [b];  stop int32 [b, n_stop] (-1 pad)

MTP speculative round (paper §2.1, MTP with shared parameters; DeepSeek-V3 §2.2, chained
EAGLE-style): the shared MTP layer keeps its own pool, indexed by the same block tables.
Its row j is computed from (token j + 1, the main model's pre-norm hidden state at j), so
with N rows in the main cache it is valid through row N - 2, and `h_last` holds the main
hidden state at row N - 1.
  1. draft 1: MTP row N - 1 from (pending token, h_last) -> q_1, d_1;
     draft k > 1: MTP row N + k - 2 from (d_{k-1}, MTP hidden of step k - 1) -> q_k, d_k.
  2. verify: one main forward over [pending, d_1 .. d_D] at rows N .. N + D.
  3. accept (sampling.speculative_accept) -> n drafts + one target token.
  4. MTP catch-up: rows N .. N + n - 1 recomputed from the verified hidden states, so the
     MTP pool again holds only main-model-derived rows. The catch-up runs in the same MTP
     call as the next round's first draft (`speculative_round`'s fold).
Rows written for rejected drafts sit beyond the sequence length: they are never visible
(each query's limit is its own position) and get overwritten.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.inference import matvec
from glm5_jax.inference import sampling
from glm5_jax.nn import embed as embed_lib
from glm5_jax.nn import kv_cache
from glm5_jax.nn import model as model_lib
from glm5_jax.nn import mtp as mtp_lib
from glm5_jax.nn import params as params_lib

STREAM_KEY = "stream_layers"   # served parameters: the streamed weights' layer indices
LAYOUT_KEY = "stream_laid_out"  # and the copies of some in nn.params.SERVED_LAYOUTS' layouts


UNSTACKED = ("mtp", "lm_head")   # streamed parts applied as modules of their own


def streamed(params, part: str):
  """The variable collections that stream the weights of `params[part]` ("layers": the
  decoder stacks; "mtp"; "lm_head") the engine serves streamed (`params[STREAM_KEY]`,
  placement.py `stream_plan`), paths relative to the module applied; {} if none."""
  plan, laid = params.get(STREAM_KEY, {}), params.get(LAYOUT_KEY, {})
  if part in UNSTACKED:
    return (params_lib.stream_collections(params[part], plan[part], laid.get(part))
            if part in plan else {})
  layers = {k: v for k, v in plan.items() if k not in UNSTACKED}
  return params_lib.stream_collections(params, layers, laid) if layers else {}


_INT_FIELDS = ("tok", "pos", "active", "n_gen", "budget", "seed", "req", "top_k")
_FLOAT_FIELDS = ("temp", "top_p")


def pack_state(st):
  """The host's decode state as three arrays (int32 [b, 8], float32 [b, 2], stop [b, n]):
  three host-to-device copies per call instead of eleven."""
  ints = np.stack([np.asarray(st[k], np.int32) for k in _INT_FIELDS], axis=1)
  floats = np.stack([np.asarray(st[k], np.float32) for k in _FLOAT_FIELDS], axis=1)
  return ints, floats, np.asarray(st["stop"], np.int32)


def unpack_state(packed):
  """Inverse of `pack_state`, on device."""
  ints, floats, stop = packed
  st = {k: ints[:, i] for i, k in enumerate(_INT_FIELDS)}
  st.update({k: floats[:, i] for i, k in enumerate(_FLOAT_FIELDS)})
  st["active"] = st["active"].astype(bool)
  st["stop"] = stop
  return st


def num_rows(cache) -> int:
  """Rows in the pool."""
  return jax.tree_util.tree_leaves(cache["layers"])[0].shape[-2]


def forward(cfg, block_size, params, cache, table_bm, tokens_bt, start_b, n_valid_b,
            routing: bool = False):
  """The main model over a chunk. Returns (ModelOutput (no logits; with `routing` its routed
  experts), updated cache)."""
  idx = kv_cache.chunk_index(table_bm, block_size, start_b, n_valid_b, tokens_bt.shape[1],
                             num_rows(cache))
  variables = {"params": params, **streamed(params, "layers")}
  return model_lib.GLM5(cfg).apply(variables, tokens_bt, idx.limit_bt, cache=cache,
                                   cache_index=idx, return_topk=True, return_logits=False,
                                   return_routing=routing)


def head(cfg, params, normed):
  """float32 logits [.., V]: the trainer's lm_head."""
  return embed_lib.Head(cfg).apply({"params": params["lm_head"], **streamed(params, "lm_head")},
                                   normed)


def lane_head(cfg, params, normed, live_b):
  """float32 logits [b, (t,) V] of a call whose idle lanes mirror its live ones
  (`mirror_idle`), normed [b, (t,) d].

  With one live lane, the head's k-blocks served (`params[matvec.HEAD_KEY]`, placement.py)
  and at most `matvec.MAX_ROWS` tokens per lane, every lane gets the live lane's rows
  through the matrix-vector kernel (inference/matvec.py: the matmul's bits, 2-3x its
  bandwidth per row); otherwise, and whenever more lanes are live, the trainer's lm_head
  over all lanes."""
  blocks = params.get(matvec.HEAD_KEY)
  rows_per_lane = 1 if normed.ndim == 2 else normed.shape[1]
  if blocks is None or rows_per_lane > matvec.MAX_ROWS:
    return head(cfg, params, normed)
  def one_lane():
    rows = normed[jnp.argmax(live_b)].reshape(rows_per_lane, -1)
    logits = jnp.stack([matvec.matvec(r, blocks) for r in rows])
    return jnp.broadcast_to(logits.reshape(normed.shape[1:-1] + logits.shape[-1:]),
                            normed.shape[:-1] + logits.shape[-1:])
  return jax.lax.cond(jnp.sum(live_b) <= 1, one_lane, lambda: head(cfg, params, normed))


def mtp(cfg, block_size, params, cache, table_bm, next_tokens_bt, h_prev_btd, start_b,
        n_valid_b, first_valid_b=None, live_b=None):
  """The MTP layer over a chunk of rows start[b] + i. Returns (h, logits, updated cache);
  `live_b`: the live lanes, the others mirroring them (`lane_head`)."""
  idx = kv_cache.chunk_index(table_bm, block_size, start_b, n_valid_b, next_tokens_bt.shape[1],
                             num_rows(cache), first_valid_b)
  h, normed, mtp_cache = mtp_lib.mtp_step(cfg, params, next_tokens_bt, h_prev_btd,
                                          idx.limit_bt, cache["mtp"], idx,
                                          streamed(params, "mtp"))
  logits = (head(cfg, params, normed) if live_b is None
            else lane_head(cfg, params, normed, live_b))
  return h, logits, {**cache, "mtp": mtp_cache}


def _stack_topk(all_idx):
  """[L, b, t, K] int32, or None for dense attention."""
  if any(i is None for i in all_idx):
    return None
  return jnp.stack(all_idx)


def _all_greedy(st):
  """True when every row decodes greedily: the steps then skip building sampling
  distributions and drawing random keys (the tokens are the same)."""
  return jnp.all(st["temp"] <= 0)


def _row_kernels(params) -> bool:
  """Whether the vocabulary's reductions run as `row_reduce`'s kernels (the same numbers):
  where the weights are served streamed, i.e. on one CPU device (placement.py)."""
  return STREAM_KEY in params


def _pick(logits_bv, st, kernel: bool):
  """Sample the next token per row; returns (token [b], raw log-prob [b])."""
  def draw():
    logq = sampling.sampling_logprobs(logits_bv, st["temp"], st["top_k"], st["top_p"])
    keys = sampling.row_keys(st["seed"], st["req"], st["n_gen"])
    return sampling.sample(keys, logq)

  tok = jax.lax.cond(_all_greedy(st), lambda: sampling.greedy(logits_bv, kernel), draw)
  return tok, sampling.raw_logprobs(logits_bv, tok, kernel)


def prefill(cfg, block_size, with_mtp, params, cache, h_last, table_bm, tokens_bt, start_b,
            n_valid_b, h_valid_b, st, routing: bool = False):
  """One prefill chunk: rows start[b] .. start[b] + n_valid[b] - 1 get tokens[b, :n_valid[b]].

  h_valid_b: bool [b], h_last holds the main hidden state of row start[b] - 1 (else the MTP
  row start[b] - 1 is already cached, or there is none).

  Returns (cache, h_last, out) with out = {tok [b], logprob [b]: a token sampled from the
  logits at each row's last valid token (used by the host where the prompt ends),
  topk [L, b, t, K] or None, routing [L_moe, b, t, K] or None}.
  """
  out, cache = forward(cfg, block_size, params, cache, table_bm, tokens_bt, start_b, n_valid_b,
                       routing)
  last = jnp.maximum(n_valid_b - 1, 0)
  take = lambda x: jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  tok, lp = _pick(head(cfg, params, take(out.hidden)), st, _row_kernels(params))
  if with_mtp:
    # MTP rows start-1 .. start+n-2 from (tokens[i], main hidden at row start-1+i).
    h0 = out.last_hidden
    h_prev = jnp.concatenate([h_last[:, None].astype(h0.dtype), h0[:, :-1]], axis=1)
    _, _, cache = mtp(cfg, block_size, params, cache, table_bm, tokens_bt, h_prev, start_b - 1,
                      n_valid_b, (~h_valid_b).astype(jnp.int32))
    h_last = jnp.where((n_valid_b > 0)[:, None], take(h0).astype(h_last.dtype), h_last)
  return cache, h_last, {"tok": tok, "logprob": lp, "topk": _stack_topk(out.topk_indices),
                         "routing": out.routing}


def _advance(st, tok_b, emit_b):
  """Account one emitted token per row where emit."""
  n_gen = st["n_gen"] + emit_b
  stop = jnp.any(tok_b[:, None] == st["stop"], axis=-1)
  active = st["active"] & ~(emit_b.astype(bool) & stop) & (n_gen < st["budget"])
  return {**st, "tok": jnp.where(emit_b > 0, tok_b, st["tok"]), "n_gen": n_gen, "active": active}


def scan_while_active(step, carry, length: int):
  """`lax.scan(step, carry, None, length)` that stops early once no row of the carry's
  decode state (`carry[-1]`, its "active" field) is active: a lone request that ends
  early in a device call does not run that call's remaining steps. Outputs of the steps
  not run are zeros (nothing emitted)."""
  shapes = jax.eval_shape(lambda c: step(c, None)[1], carry)
  outs = jax.tree.map(lambda s: jnp.zeros((length,) + s.shape, s.dtype), shapes)

  def body(state):
    i, carry, outs = state
    carry, out = step(carry, None)
    outs = jax.tree.map(lambda o, x: jax.lax.dynamic_update_index_in_dim(o, x, i, 0), outs, out)
    return i + 1, carry, outs

  go = lambda state: (state[0] < length) & jnp.any(state[1][-1]["active"])
  _, carry, outs = jax.lax.while_loop(go, body, (jnp.int32(0), carry, outs))
  return carry, outs


def mirror_idle(active_b, *xs):
  """Each x [b, ...] with the rows of idle lanes (not active) replaced by the first active
  lane's. A step's idle lanes (padding for batch invariance, requests that ended) have no
  valid token, so nothing of theirs is written or kept; mirroring a live lane, they route
  to its experts and read its cache rows, so they cost the step no memory traffic of their
  own (zeros would route to K other experts). Each row's result does not depend on the
  other rows, so the live lanes' bits do not change."""
  src = jnp.argmax(active_b)
  return tuple(jnp.where(active_b.reshape((-1,) + (1,) * (x.ndim - 1)), x, x[src]) for x in xs)


def decode(cfg, block_size, n_steps, params, cache, table_bm, st, routing: bool = False):
  """Up to n_steps plain decode steps (`scan_while_active`), idle lanes mirroring a live one
  (`mirror_idle`). Returns (cache, st, per-step outputs)."""

  def step(carry, _):
    cache, st = carry
    emit = st["active"].astype(jnp.int32)
    tok, pos, table = mirror_idle(st["active"], st["tok"], st["pos"], table_bm)
    out, cache = forward(cfg, block_size, params, cache, table, tok[:, None], pos, emit,
                         routing)
    tok, lp = _pick(lane_head(cfg, params, out.hidden[:, 0], st["active"]), st,
                    _row_kernels(params))
    topk = _stack_topk(out.topk_indices)
    res = {"tok": tok, "logprob": lp, "emit": emit, "pos": st["pos"],
           "topk": None if topk is None else topk[:, :, 0],
           "routing": None if out.routing is None else out.routing[:, :, 0]}
    st = _advance({**st, "pos": st["pos"] + emit}, tok, emit)
    return (cache, st), res

  (cache, st), outs = scan_while_active(step, (cache, st), n_steps)
  return cache, st, outs


def init_fold(st, h_last, n_draft):
  """The speculative carry before the first round: MTP row pos - 1 from (pending, h_last)."""
  b = st["tok"].shape[0]
  tok = jnp.zeros((b, n_draft + 1), jnp.int32).at[:, 0].set(st["tok"])
  h = jnp.zeros((b, n_draft + 1, h_last.shape[-1]), h_last.dtype).at[:, 0].set(h_last)
  return {"tok": tok, "h": h, "n": jnp.ones((b,), jnp.int32)}


def finish_fold(cfg, block_size, params, cache, fold, table_bm, st):
  """The last round's MTP catch-up (rows pos - n .. pos - 2). Returns (cache, h_last)."""
  n = fold["n"]
  _, _, cache = mtp(cfg, block_size, params, cache, table_bm, fold["tok"], fold["h"],
                    st["pos"] - n, jnp.maximum(n - 1, 0))
  last = jnp.maximum(n - 1, 0)[:, None, None]
  return cache, jnp.take_along_axis(fold["h"], last, axis=1)[:, 0]


def pad_lanes(x, n: int, value=0):
  """x [b, ...] with inert lanes appended up to n rows."""
  return jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def speculative_round(cfg, block_size, n_draft, params, cache, fold, table_bm, st,
                      min_draft_lanes: int = 1, routing: bool = False):
  """One draft / verify / accept round (module docstring). Returns (cache, fold, st, out)
  with out = {tok [b, D+1], logprob [b, D+1], n_emit [b], n_accepted [b], pos [b],
  topk [L, b, D+1, K] or None}; row b emitted tok[b, :n_emit[b]].

  fold: the previous round's emitted tokens and their verify hidden states {tok [b, D+1],
  h [b, D+1, d], n [b]} (`init_fold` before the first round). The previous round's MTP
  catch-up (rows start .. pos - 2) and this round's first draft (row pos - 1, from the
  pending token and h at pos - 1) are one MTP call over those rows: the catch-up is folded
  into the next round (`finish_fold` after the last one).
  min_draft_lanes: the drafting steps after the first (one token per lane) run over at
  least this many lanes, the others inert (mirroring a live lane, as every idle lane of a
  round does: `mirror_idle`): the engine's batch-invariant row count
  (`engine.invariant_tokens`), so that a request's drafts, like its verified tokens, do not
  depend on the batch it shares. The verify and the catch-up carry D + 1 tokens per lane.
  """
  b, d = st["tok"].shape[0], n_draft
  act = st["active"].astype(jnp.int32)
  n0 = st["pos"]
  all_greedy = _all_greedy(st)
  kernel = _row_kernels(params)
  def draw_keys():                                                       # [b, D+1, key]
    keys = sampling.row_keys(st["seed"], st["req"], st["n_gen"])
    return jax.vmap(lambda k: jax.random.split(k, d + 1))(keys)
  shape = jax.eval_shape(draw_keys)
  keys = jax.lax.cond(all_greedy, lambda: jnp.zeros(shape.shape, shape.dtype), draw_keys)
  rep = lambda x: jnp.repeat(x, d + 1, axis=0)

  def sample_draft(logits_bv, k):
    def draw():
      logq = sampling.sampling_logprobs(logits_bv, st["temp"], st["top_k"], st["top_p"])
      return sampling.sample(keys[:, k], logq), logq
    return jax.lax.cond(all_greedy, lambda: (sampling.greedy(logits_bv, kernel),
                                             jnp.zeros(logits_bv.shape, jnp.float32)), draw)

  # 1. Draft with the shared MTP module: catch-up rows + draft 1 in one call, then one
  #    scanned step per further draft.
  fn = fold["n"]
  live = st["active"]
  h, logits, cache = mtp(cfg, block_size, params, cache,
                         *mirror_idle(live, table_bm, fold["tok"], fold["h"], n0 - fn),
                         fn * act, live_b=live)
  at = jnp.maximum(fn - 1, 0)[:, None, None]
  h1 = jnp.take_along_axis(h, at, axis=1)[:, 0]
  tok1, logq1 = sample_draft(jnp.take_along_axis(logits, at, axis=1)[:, 0], 0)

  lanes = max(b, min_draft_lanes)
  pad_table = pad_lanes(table_bm, lanes, num_rows(cache) // block_size)   # no block held

  pad_live = pad_lanes(live, lanes)

  def draft(carry, k):
    cache, tok_b, h_bd = carry
    h, logits, cache = mtp(cfg, block_size, params, cache,
                           *mirror_idle(pad_live, pad_table, pad_lanes(tok_b[:, None], lanes),
                                        pad_lanes(h_bd[:, None], lanes),
                                        pad_lanes(n0 - 1 + k, lanes)),
                           pad_lanes(act, lanes), live_b=pad_live)
    tok_b, logq = sample_draft(logits[:b, 0], k)
    return (cache, tok_b, h[:b, 0].astype(h_bd.dtype)), (tok_b, logq)

  (cache, _, _), (drafts, logqs) = jax.lax.scan(draft, (cache, tok1, h1.astype(fold["h"].dtype)),
                                                jnp.arange(1, d))
  drafts_bd = jnp.concatenate([tok1[:, None], drafts.swapaxes(0, 1)], axis=1)
  logq_bdv = jnp.concatenate([logq1[:, None], logqs.swapaxes(0, 1)], axis=1)

  # 2. Verify with one main-model forward over D + 1 tokens.
  vtok = jnp.concatenate([st["tok"][:, None], drafts_bd], axis=1)
  out, cache = forward(cfg, block_size, params, cache, *mirror_idle(live, table_bm, vtok, n0),
                       act * (d + 1), routing)
  h0 = out.last_hidden
  logits = lane_head(cfg, params, out.hidden, live)                      # [b, D+1, V]
  v = logits.shape[-1]

  # 3. Accept, then cut at a stop token or the budget.
  def accept():
    logp = sampling.sampling_logprobs(logits.reshape(b * (d + 1), v), rep(st["temp"]),
                                      rep(st["top_k"]), rep(st["top_p"])).reshape(b, d + 1, v)
    return sampling.speculative_accept(keys[:, d], drafts_bd, logq_bdv, logp)

  n_acc, y = jax.lax.cond(all_greedy,
                          lambda: sampling.greedy_accept(drafts_bd, logits, kernel), accept)
  i_t = jnp.arange(d + 1)[None, :]
  out_tok = jnp.where(i_t < n_acc[:, None], jnp.pad(drafts_bd, ((0, 0), (0, 1))), y[:, None])
  out_lp = sampling.raw_logprobs(logits, out_tok, kernel)
  is_stop = jnp.any(out_tok[..., None] == st["stop"][:, None, :], axis=-1) & (i_t <= n_acc[:, None])
  has_stop = jnp.any(is_stop, -1)
  first_stop = jnp.where(has_stop, jnp.argmax(is_stop, -1) + 1, d + 1)
  n_emit = jnp.minimum(jnp.minimum(n_acc + 1, st["budget"] - st["n_gen"]), first_stop) * act

  # 4. The carry: MTP rows n0 .. n0 + n_emit - 1 come from (emitted token i, h0[i]).
  keep = n_emit > 0
  fold = {"tok": jnp.where(keep[:, None], out_tok, fold["tok"]),
          "h": jnp.where(keep[:, None, None], h0.astype(fold["h"].dtype), fold["h"]),
          "n": jnp.where(keep, n_emit, fold["n"])}
  last = jnp.maximum(n_emit - 1, 0)[:, None]
  n_gen = st["n_gen"] + n_emit
  stopped = has_stop & (first_stop <= n_emit) & keep
  st = {**st, "tok": jnp.where(keep, jnp.take_along_axis(out_tok, last, 1)[:, 0], st["tok"]),
        "pos": n0 + n_emit, "n_gen": n_gen,
        "active": st["active"] & ~stopped & (n_gen < st["budget"])}
  res = {"tok": out_tok, "logprob": out_lp, "n_emit": n_emit, "n_accepted": n_acc * act,
         "pos": n0, "topk": _stack_topk(out.topk_indices), "routing": out.routing}
  return cache, fold, st, res


@functools.lru_cache(maxsize=32)
def jit_steps(cfg, block_size: int, with_mtp: bool, steps_per_sync: int, num_draft: int,
              rounds_per_sync: int, min_draft_lanes: int, routing: bool = False):
  """The jitted steps of an engine (prefill, decode, speculative, set_h), shared by every
  engine of the same configuration (an evaluation engine, a restarted rollout worker), so
  their compilations are reused. Their host arguments are packing.py's:

  prefill (params, cache, h_all, lanes, table, tokens, start, n_valid, h_valid, packed state)
  -> (cache, h_all, out); decode (params, cache, table, packed state) -> (cache, {pos,
  active}, outs per step); speculative (params, cache, h_all, lanes, table, packed state) ->
  (cache, h_all, {pos, active}, outs per round); set_h (h_all, slot, row) -> h_all.
  h_all [max_batch, d] holds each slot's MTP hidden state (`prefill`'s h_last); a call over
  lanes (int32 [n], each lane's slot; max_batch: padding) reads and writes their rows. The
  cache and h_all are donated."""
  def prefill_fn(params, cache, h_all, lanes, table, tokens, start, n_valid, h_valid, packed):
    cache, h, out = prefill(cfg, block_size, with_mtp, params, cache,
                            jnp.take(h_all, lanes, axis=0, mode="clip"), table, tokens,
                            start, n_valid, h_valid, unpack_state(packed), routing)
    return cache, h_all.at[lanes].set(h, mode="drop"), out

  def decode_fn(params, cache, table, packed):
    cache, st, out = decode(cfg, block_size, steps_per_sync, params, cache, table,
                            unpack_state(packed), routing)
    return cache, {"pos": st["pos"], "active": st["active"]}, out

  def speculative_fn(params, cache, h_all, lanes, table, packed):
    st = unpack_state(packed)
    h_last = jnp.take(h_all, lanes, axis=0, mode="clip")
    def body(carry, _):
      cache, fold, st = carry
      cache, fold, st, out = speculative_round(cfg, block_size, num_draft, params, cache,
                                               fold, table, st, min_draft_lanes, routing)
      return (cache, fold, st), out
    fold = init_fold(st, h_last, num_draft)
    (cache, fold, st), outs = scan_while_active(body, (cache, fold, st), rounds_per_sync)
    cache, h_last = finish_fold(cfg, block_size, params, cache, fold, table, st)
    h_all = h_all.at[lanes].set(h_last, mode="drop")
    return cache, h_all, {"pos": st["pos"], "active": st["active"]}, outs

  set_h = lambda h, i, row: h.at[i].set(row.astype(h.dtype))
  return (jax.jit(prefill_fn, donate_argnums=(1, 2)),
          jax.jit(decode_fn, donate_argnums=(1,)),
          jax.jit(speculative_fn, donate_argnums=(1, 2)),
          jax.jit(set_h, donate_argnums=(0,)))
