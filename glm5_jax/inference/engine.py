"""Engine: batched, KV-cached generation with exact raw log-probs and sessions.

    engine = Engine(cfg, params, max_batch=8, max_len=4096)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16, seed=0))
    outs[0].token_ids, outs[0].logprobs

The cache has `max_batch` slots of `max_len` rows (forward.py: per layer the
latent row [c_kv | k_rope] and the indexer key, nothing per head). Every
device step runs on all slots; slots not in the current call are inert
(n_valid = 0: nothing written, outputs ignored). A request occupies a slot
for one `generate` call; a session (`new_session`) holds its slot until
`end_session`, and each `generate(..., session_id=...)` appends the new turn
after the cached conversation (the last sampled token of the previous turn
is fed first), without prefilling it again. Token ids in, token ids out.

Shapes are bucketed so that new prompt lengths do not recompile: prefill runs
in chunks of `prefill_chunk` tokens, the last chunk padded to a power of two
>= 16; decode runs `steps_per_sync` steps per call; a speculative round has
D + 1 tokens. Padding is never written and never attended to (forward.py).

Errors (ValueError, raised before any state changes, so the engine stays
usable): empty prompt, prompt longer than the cache, unknown session, more
requests than free slots, token ids outside the vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.inference import forward
from glm5_jax.inference import steps
from glm5_jax.inference.sampling import SamplingParams


@dataclasses.dataclass
class GenerationOutput:
  """One request's result.

  Attributes:
    token_ids: generated ids (stop token included).
    logprobs: raw-model log-prob of each generated id (before temperature,
      top-k, top-p), float32 values as Python floats.
    finish_reason: "stop" | "length" (max_new_tokens) | "cache_full".
    session_id: the session this turn belongs to, or None.
    num_rounds: speculative verify rounds (0 without speculative decoding).
    num_accepted: drafts accepted over those rounds.
    topk_indices: with `record_topk=True`, {absolute position: int32 [L, K]}
      the DSA top-k each layer chose for the token at that position.
  """
  token_ids: list
  logprobs: list
  finish_reason: str
  session_id: str | None = None
  num_rounds: int = 0
  num_accepted: int = 0
  topk_indices: dict | None = None

  @property
  def acceptance_length(self) -> float:
    """Tokens emitted per verify forward (1 + accepted drafts per round)."""
    return len(self.token_ids) / self.num_rounds if self.num_rounds else float("nan")


@dataclasses.dataclass
class _Slot:
  tokens: list            # the conversation: cached rows + the pending last token
  cache_len: int          # rows 0 .. cache_len - 1 hold tokens[:cache_len]
  session_id: str | None


def _buckets(chunk: int):
  out, b = [], 16
  while b < chunk:
    out.append(b)
    b *= 2
  return out + [chunk]


class Engine:
  """KV-cached GLM-5 inference (see module docstring)."""

  def __init__(self, cfg, params, *, max_batch: int = 8, max_len: int = 4096,
               prefill_chunk: int = 256, steps_per_sync: int = 8, speculative: bool = False,
               num_draft: int | None = None, attention_form: str = "absorbed"):
    """Args:
      cfg: ModelConfig.
      params: the model's parameter tree (nn.init_params / hf.load_pretrained).
      max_batch: cache slots (concurrent requests + open sessions).
      max_len: cache rows per slot (prompt + conversation + generated tokens).
      prefill_chunk: tokens per prefill step (chunked prefill).
      steps_per_sync: decode steps per device call (host checks for stop after each).
      speculative: draft with the MTP module and verify (needs cfg with MTP).
      num_draft: drafts per round (default cfg.mtp_num_steps).
      attention_form: "absorbed" (decode default) or "expanded" (benchmarks).
    """
    for name, v in (("max_batch", max_batch), ("max_len", max_len),
                    ("prefill_chunk", prefill_chunk), ("steps_per_sync", steps_per_sync)):
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"Engine {name}={v!r}: expected a positive int")
    if max_len > cfg.max_position_embeddings:
      raise ValueError(f"Engine max_len={max_len}: expected <= ModelConfig."
                       f"max_position_embeddings={cfg.max_position_embeddings}")
    if attention_form not in forward.ATTENTION_FORMS:
      raise ValueError(f"Engine attention_form={attention_form!r}: expected one of "
                       f"{forward.ATTENTION_FORMS}")
    num_draft = cfg.mtp_num_steps if num_draft is None else num_draft
    if speculative:
      if not cfg.num_nextn_predict_layers or "mtp" not in params:
        raise ValueError("Engine speculative=True needs the MTP module: ModelConfig."
                         f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} and params "
                         "with an 'mtp' subtree")
      if num_draft < 1:
        raise ValueError(f"Engine num_draft={num_draft}: expected >= 1 with speculative=True")
    self.cfg, self.params = cfg, params
    self.max_batch, self.max_len = max_batch, max_len
    self.prefill_chunk = min(prefill_chunk, max_len)
    self.steps_per_sync, self.speculative, self.num_draft = steps_per_sync, speculative, num_draft
    self.attention_form = attention_form
    self._buckets = _buckets(self.prefill_chunk)
    self._slots: list[_Slot | None] = [None] * max_batch
    self._sessions: dict[str, int] = {}
    self._session_counter = itertools.count()
    self.last_stats: dict = {}

    def init_cache():
      layers = [forward.init_layer_cache(cfg, max_batch, max_len, cfg.indexer_type(i) == "full")
                for i in range(cfg.num_hidden_layers)]
      mtp = forward.init_layer_cache(cfg, max_batch, max_len, True) if speculative else None
      return {"layers": layers, "mtp": mtp}
    self._cache = jax.jit(init_cache)()
    self._h_last = jnp.zeros((max_batch, cfg.hidden_size), cfg.dtype)
    self._jitted = {}
    self._first = jax.jit(steps.first_token)

  def _fns(self, form: str):
    """(prefill, decode, speculative round) jitted for one attention form, built once."""
    if form not in self._jitted:
      cfg = self.cfg
      self._jitted[form] = (
          jax.jit(functools.partial(steps.prefill, cfg, form, self.speculative),
                  donate_argnums=(1,)),
          jax.jit(functools.partial(steps.decode, cfg, form, self.steps_per_sync),
                  donate_argnums=(1,)),
          jax.jit(functools.partial(steps.speculative_round, cfg, form, self.num_draft),
                  donate_argnums=(1,)))
    return self._jitted[form]

  # ------------------------------------------------------------------ sessions
  def new_session(self) -> str:
    """Reserves a cache slot for a multi-turn conversation; returns its id."""
    free = self._free_slots()
    if not free:
      raise ValueError(f"new_session: all max_batch={self.max_batch} cache slots are in use "
                       f"({len(self._sessions)} by sessions); end a session first")
    sid = f"session-{next(self._session_counter)}"
    self._slots[free[0]] = _Slot([], 0, sid)
    self._sessions[sid] = free[0]
    return sid

  def end_session(self, session_id: str) -> None:
    """Frees the session's slot."""
    slot = self._session_slot(session_id)
    self._slots[slot] = None
    del self._sessions[session_id]

  def session_tokens(self, session_id: str) -> list:
    """The session's conversation so far: every prompt and generated token, in order."""
    return list(self._slots[self._session_slot(session_id)].tokens)

  def _session_slot(self, session_id) -> int:
    if session_id not in self._sessions:
      raise ValueError(f"session_id={session_id!r} is unknown; open sessions: "
                       f"{sorted(self._sessions)}")
    return self._sessions[session_id]

  def _free_slots(self):
    return [i for i, s in enumerate(self._slots) if s is None]

  # ------------------------------------------------------------------ generate
  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[
      SamplingParams] = SamplingParams(), *, session_id=None, record_topk: bool = False,
               attention_form: str | None = None) -> list[GenerationOutput]:
    """Generates a continuation for each prompt (token ids in, token ids out).

    Args:
      prompts: token-id lists, one per request.
      sampling: one SamplingParams for all requests or one per request.
      session_id: None, one id (one prompt), or one id (or None) per prompt;
        a session's prompt is appended to its cached conversation.
      record_topk: also return each layer's DSA top-k per processed position.
      attention_form: override the engine's form for this call ("absorbed" |
        "expanded"; the cache is the same for both).

    Returns:
      One GenerationOutput per prompt, in order.
    """
    form = attention_form or self.attention_form
    if form not in forward.ATTENTION_FORMS:
      raise ValueError(f"attention_form={form!r}: expected one of {forward.ATTENTION_FORMS}")
    prompts = [list(p) for p in prompts]
    sps = self._check_sampling(sampling, len(prompts))
    sids = self._check_sessions(session_id, len(prompts))
    rows = self._check_and_assign(prompts, sids)        # raises before any state change
    try:
      return self._run(prompts, sps, sids, rows, record_topk, self._fns(form))
    finally:
      for r, sid in zip(rows, sids):
        if sid is None:
          self._slots[r] = None

  def _check_sampling(self, sampling, n):
    sps = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
    if len(sps) != n or not all(isinstance(s, SamplingParams) for s in sps):
      raise ValueError(f"sampling: expected one SamplingParams or a list of {n}, got {sampling!r}")
    return sps

  def _check_sessions(self, session_id, n):
    if session_id is None or isinstance(session_id, str):
      if session_id is not None and n != 1:
        raise ValueError(f"session_id={session_id!r} with {n} prompts: pass one id per prompt")
      sids = [session_id] * n
    else:
      sids = list(session_id)
      if len(sids) != n:
        raise ValueError(f"session_id: {len(sids)} ids for {n} prompts")
    named = [s for s in sids if s is not None]
    if len(set(named)) != len(named):
      raise ValueError(f"session_id: a session appears twice in one call: {named}")
    for s in named:
      self._session_slot(s)
    return sids

  def _check_and_assign(self, prompts, sids):
    if not prompts:
      raise ValueError("prompts: expected at least one prompt")
    v = self.cfg.vocab_size
    for i, (p, sid) in enumerate(zip(prompts, sids)):
      prefix = 0 if sid is None else len(self._slots[self._sessions[sid]].tokens)
      if not p and prefix == 0:
        raise ValueError(f"prompts[{i}] is empty: expected at least one token id")
      if any((not isinstance(t, (int, np.integer))) or t < 0 or t >= v for t in p):
        raise ValueError(f"prompts[{i}]: token ids must be ints in [0, vocab_size={v})")
      if prefix + len(p) > self.max_len:
        raise ValueError(f"prompts[{i}]: {len(p)} tokens" + (f" after {prefix} session tokens"
                         if prefix else "") + f" do not fit the cache (Engine max_len="
                         f"{self.max_len})")
    free = self._free_slots()
    need = sum(s is None for s in sids)
    if need > len(free):
      raise ValueError(f"batch of {need} new requests needs {need} free cache slots; "
                       f"max_batch={self.max_batch}, {len(free)} free ({len(self._sessions)} "
                       "held by sessions)")
    rows, it = [], iter(free)
    for sid in sids:
      if sid is None:
        r = next(it)
        self._slots[r] = _Slot([], 0, None)
      else:
        r = self._sessions[sid]
      rows.append(r)
    return rows

  def _state(self, sps, rows, feeds):
    """Host-built decode state (steps.py) for the participating rows."""
    b = self.max_batch
    n_stop = max([1] + [len(s.stop_token_ids) for s in sps])
    n_stop = 1 << (n_stop - 1).bit_length()              # bucket: few recompiles
    st = {"tok": np.zeros(b, np.int32), "pos": np.zeros(b, np.int32),
          "active": np.zeros(b, bool), "n_gen": np.zeros(b, np.int32),
          "budget": np.zeros(b, np.int32), "seed": np.zeros(b, np.int32),
          "req": np.zeros(b, np.int32), "temp": np.zeros(b, np.float32),
          "top_k": np.zeros(b, np.int32), "top_p": np.ones(b, np.float32),
          "stop": np.full((b, n_stop), -1, np.int32)}
    for i, (r, sp) in enumerate(zip(rows, sps)):
      slot = self._slots[r]
      total = slot.cache_len + len(feeds[i])
      st["pos"][r] = total
      st["active"][r] = True
      st["budget"][r] = min(sp.max_new_tokens, self.max_len - total + 1)
      st["seed"][r], st["req"][r] = sp.seed, i
      st["temp"][r], st["top_k"][r], st["top_p"][r] = sp.temperature, sp.top_k, sp.top_p
      st["stop"][r, :len(sp.stop_token_ids)] = sp.stop_token_ids
    return {k: jnp.asarray(v) for k, v in st.items()}

  def _run(self, prompts, sps, sids, rows, record_topk, fns):
    prefill_fn, decode_fn, spec_fn = fns
    t0 = time.perf_counter()
    feeds = []
    for r, p in zip(rows, prompts):
      slot = self._slots[r]
      feeds.append(slot.tokens[slot.cache_len:] + p)
    starts = [self._slots[r].cache_len for r in rows]
    topk = [dict() if record_topk else None for _ in rows]
    last_logits = self._prefill_all(prefill_fn, rows, feeds, starts, topk)
    st = self._state(sps, rows, feeds)
    st, tok, lp, _ = self._first(last_logits, st)
    jax.block_until_ready(tok)
    t1 = time.perf_counter()
    gen = [[int(tok[r])] for r in rows]
    lps = [[float(lp[r])] for r in rows]
    rounds, accepted = [0] * len(rows), [0] * len(rows)
    active = np.asarray(st["active"])
    while active.any():
      if self.speculative:
        self._cache, self._h_last, st, out = spec_fn(self.params, self._cache, self._h_last, st)
        out = jax.device_get(out)
        for i, r in enumerate(rows):
          e = int(out["n_emit"][r])
          if e:
            gen[i] += out["tok"][r, :e].tolist()
            lps[i] += out["logprob"][r, :e].tolist()
            rounds[i] += 1
            accepted[i] += int(min(out["n_accepted"][r], e))
            if topk[i] is not None and out["topk"] is not None:
              for j in range(e):
                topk[i][int(out["pos"][r]) + j] = out["topk"][:, r, j]
      else:
        self._cache, st, out = decode_fn(self.params, self._cache, st)
        out = jax.device_get(out)
        for i, r in enumerate(rows):
          emitted = out["emit"][:, r] > 0
          gen[i] += out["tok"][emitted, r].tolist()
          lps[i] += out["logprob"][emitted, r].tolist()
          if topk[i] is not None and out["topk"] is not None:
            for s in np.nonzero(emitted)[0]:
              topk[i][int(out["pos"][s, r])] = out["topk"][s, :, r]
      active = np.asarray(st["active"])
    t2 = time.perf_counter()

    outs = []
    for i, (r, sp, sid) in enumerate(zip(rows, sps, sids)):
      slot = self._slots[r]
      slot.tokens = slot.tokens + prompts[i] + gen[i]
      slot.cache_len = len(slot.tokens) - 1
      if gen[i][-1] in sp.stop_token_ids:
        reason = "stop"
      elif len(gen[i]) >= sp.max_new_tokens:
        reason = "length"
      else:
        reason = "cache_full"
      outs.append(GenerationOutput(gen[i], lps[i], reason, sid, rounds[i], accepted[i], topk[i]))
    n_tok = sum(len(g) for g in gen)
    self.last_stats = {"prefill_s": t1 - t0, "decode_s": t2 - t1,
                       "prefill_tokens": sum(len(f) for f in feeds), "generated_tokens": n_tok,
                       "decode_tokens_per_s": (n_tok - len(rows)) / max(t2 - t1, 1e-9),
                       "rounds": sum(rounds), "accepted": sum(accepted)}
    return outs

  def _prefill_all(self, prefill_fn, rows, feeds, starts, topk):
    """Chunked prefill of every participating row. Returns last logits [b, V]."""
    b = self.max_batch
    done = [0] * len(rows)
    last_logits = jnp.zeros((b, self.cfg.vocab_size), jnp.float32)
    while any(d < len(f) for d, f in zip(done, feeds)):
      longest = max(len(f) - d for d, f in zip(done, feeds))
      t = next(x for x in self._buckets if x >= min(longest, self.prefill_chunk))
      tokens = np.zeros((b, t), np.int32)
      start = np.zeros(b, np.int32)
      n_valid = np.zeros(b, np.int32)
      for i, r in enumerate(rows):
        piece = feeds[i][done[i]:done[i] + t]
        tokens[r, :len(piece)] = piece
        start[r], n_valid[r] = starts[i] + done[i], len(piece)
      self._cache, self._h_last, logits, idx = prefill_fn(
          self.params, self._cache, self._h_last, jnp.asarray(tokens), jnp.asarray(start),
          jnp.asarray(n_valid))
      last_logits = jnp.where(jnp.asarray(n_valid > 0)[:, None], logits, last_logits)
      if idx is not None and any(t_ is not None for t_ in topk):
        idx = np.asarray(idx)
        for i, r in enumerate(rows):
          if topk[i] is not None:
            for j in range(n_valid[r]):
              topk[i][int(start[r]) + j] = idx[:, r, j]
      for i, r in enumerate(rows):
        done[i] += int(n_valid[r])
    return last_logits
