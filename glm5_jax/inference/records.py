"""The engine's records of requests, sessions and results, and the checks of what users submit.

Host-side Python only (no jax): a `Request` is one generation in flight (its conversation,
budget, blocks, slot and what it generated so far), a `Session` a conversation that keeps
its cache blocks between turns, a `GenerationOutput` what `Engine.step` returns. The checks
raise ValueError naming the argument and the allowed values, before anything is queued.
"""

from __future__ import annotations

import collections.abc
import dataclasses

import numpy as np


@dataclasses.dataclass
class GenerationOutput:
  """One request's result.

  Attributes:
    request_id: the id `submit` returned.
    token_ids: generated ids (stop token included).
    logprobs: raw-model log-prob of each generated id (before temperature, top-k, top-p),
      float32 values as Python floats.
    versions: the weight version that produced each generated id.
    finish_reason: "stop" | "length" (max_new_tokens) | "cache_full" (max_len).
    session_id: the session this turn belongs to, or None.
    num_rounds: speculative verify rounds (0 without speculative decoding).
    num_accepted: drafts accepted over those rounds.
    topk_indices: with `record_topk=True`, {absolute position: int32 [L, K]} the DSA
      top-k each layer chose for the token at that position, from its first computation:
      for a position followed by a generated token, the step that sampled that token (a
      re-prefill after `update_params` does not overwrite it), so it belongs to that token's
      recorded version.
    num_cached_prompt_tokens: prompt rows taken from the cache (a session's conversation or
      a shared prefix) instead of being prefilled.
    routing: with `record_routing=True`, {absolute position: int32 [L_moe, K]} the experts
      each MoE layer routed the token at that position to (the same first-computation rule
      as `topk_indices`).

  Records of rows a request took from a shared prefix come from the request that computed
  them (the engine keeps them with the cached blocks), so every processed position is
  recorded once per request.
  """
  request_id: int
  token_ids: list
  logprobs: list
  versions: list
  finish_reason: str
  session_id: str | None = None
  num_rounds: int = 0
  num_accepted: int = 0
  topk_indices: dict | None = None
  num_cached_prompt_tokens: int = 0
  routing: dict | None = None

  @property
  def acceptance_length(self) -> float:
    """Tokens emitted per verify round (1 + accepted drafts); the first token, sampled
    from the prefill's logits, is not a verified one."""
    return (len(self.token_ids) - 1) / self.num_rounds if self.num_rounds else float("nan")


@dataclasses.dataclass
class Session:
  sid: str
  tokens: list = dataclasses.field(default_factory=list)   # cached rows + the pending token
  blocks: list = dataclasses.field(default_factory=list)
  cache_len: int = 0
  h_last: object = None          # MTP: main hidden state of row cache_len - 1 (host copy)
  busy: bool = False
  last_used: int = 0
  shard: int = 0                 # the pool shard of its blocks (sharded serving)


@dataclasses.dataclass
class Request:
  rid: int
  stream: int
  sampling: object               # SamplingParams
  session: Session | None
  record_topk: bool
  tokens: list                   # conversation: cached rows, rows to prefill, the pending token
  budget: int
  leader: int | None = None      # the copy whose prefill this one waits for (n > 1)
  blocks: list = dataclasses.field(default_factory=list)
  shard: int = 0
  cache_len: int = 0
  slot: int | None = None
  h_valid: bool = False
  sampled: bool = False
  prefilled: bool = False
  gen: list = dataclasses.field(default_factory=list)
  lps: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  topk: dict | None = None
  routing: dict | None = None
  rounds: int = 0
  accepted: int = 0
  cached_prompt: int = 0
  active: bool = True

  @property
  def feed_end(self) -> int:
    """Rows to have in the cache before decoding: all but the pending token."""
    return len(self.tokens) - 1 if self.sampled else len(self.tokens)

  @property
  def prefilling(self) -> bool:
    """Rows of its conversation are still to be cached (a prefill step's work)."""
    return self.cache_len < self.feed_end

  @property
  def decoding(self) -> bool:
    """Has its pending token and every row before it cached (a decode step's work)."""
    return self.active and self.sampled and self.cache_len == self.feed_end

  def record(self, start: int, topk_ti=None, routing_ti=None) -> None:
    """Keeps the records (top-k, routing; [t, ...] per row) of rows start .. start + t - 1,
    where none is kept yet: the first computation wins, so a re-prefill after a weight swap
    keeps the record of the step that sampled the token."""
    for mine, rows in ((self.topk, topk_ti), (self.routing, routing_ti)):
      if mine is not None and rows is not None:
        for j, row in enumerate(rows):
          mine.setdefault(start + j, row)

  def emit(self, tok: int, lp: float, pos: int, version, topk_lk=None, routing_lk=None):
    """Accounts one generated token (sampled for position pos + 1) under weight `version`."""
    self.gen.append(tok)
    self.lps.append(lp)
    self.versions.append(version)
    self.tokens.append(tok)
    self.sampled = True
    if self.topk is not None and topk_lk is not None:
      self.topk[pos] = topk_lk
    if self.routing is not None and routing_lk is not None:
      self.routing[pos] = routing_lk
    if tok in self.sampling.stop_token_ids or len(self.gen) >= self.budget:
      self.active = False

  def output(self) -> GenerationOutput:
    sp = self.sampling
    if self.gen and self.gen[-1] in sp.stop_token_ids:
      reason = "stop"
    elif len(self.gen) >= sp.max_new_tokens:
      reason = "length"
    else:
      reason = "cache_full"
    return GenerationOutput(self.rid, self.gen, self.lps, self.versions, reason,
                            None if self.session is None else self.session.sid, self.rounds,
                            self.accepted, self.topk, self.cached_prompt, self.routing)


def is_token_id(t) -> bool:
  """A Python or NumPy integer; bool (an int subclass) and np.bool_ are not."""
  return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


def as_prompt(ids, name: str) -> list:
  """`ids` as a list; a scalar or a string is an error naming `name`."""
  try:
    flat = not isinstance(ids, (str, bytes)) and np.ndim(ids) == 1
  except ValueError:                               # ragged nesting
    flat = False
  if not flat:
    raise ValueError(f"{name}={ids!r:.80}: expected a list of token ids" + (
        "; `generate` takes a list of prompts, e.g. [[1, 2, 3]] for one prompt"
        if name.startswith("prompts[") else ""))
  return list(ids)


def as_prompts(prompts) -> list:
  """`generate`'s prompts as a non-empty list of lists of token ids."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, collections.abc.Iterable):
    raise ValueError(f"prompts: expected a list of prompts (token-id lists), got "
                     f"{type(prompts).__name__}")
  prompts = [as_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
  if not prompts:
    raise ValueError("prompts: expected at least one prompt")
  return prompts


def check_prompt(prompt, conv, vocab_size: int, max_len: int) -> None:
  """A prompt (after a session's conversation `conv`): not empty, ids in the vocabulary,
  fits max_len rows."""
  if not prompt and not conv:
    raise ValueError("prompt is empty: expected at least one token id")
  for i, t in enumerate(prompt):
    if not is_token_id(t) or not 0 <= t < vocab_size:
      raise ValueError(f"prompt[{i}]={t!r}: token ids must be ints (not bools) in "
                       f"[0, vocab_size={vocab_size})")
  if len(conv) + len(prompt) > max_len:
    raise ValueError(f"prompt: {len(prompt)} tokens" + (f" after {len(conv)} session tokens"
                     if conv else "") + f" do not fit the cache (Engine max_len={max_len})")


def check_prompts(prompts, convs, samplings, vocab_size: int, max_len: int) -> None:
  """`check_prompt` and `check_stop_ids` of every prompt of a `generate` call, an error
  naming the prompt's index."""
  for i, (p, conv, sp) in enumerate(zip(prompts, convs, samplings)):
    try:
      check_prompt(p, conv, vocab_size, max_len)
      check_stop_ids(sp, vocab_size)
    except ValueError as e:
      raise ValueError(f"prompts[{i}]: {e}") from None


def check_stop_ids(sampling, vocab_size: int) -> None:
  bad = [t for t in sampling.stop_token_ids if t >= vocab_size]
  if bad:
    raise ValueError(f"SamplingParams.stop_token_ids={list(sampling.stop_token_ids)}: "
                     f"{bad} outside the vocabulary; expected ids in [0, vocab_size="
                     f"{vocab_size})")


def check_n(n) -> None:
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"submit: n={n!r}, expected an int >= 1")


def session_ids(session_id, n: int, session_of) -> list:
  """`generate`'s session_id (None, one id, or one id or None per prompt) as n ids, each
  open (`session_of` raises for an unknown one) and without a turn in flight."""
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
    if session_of(s).busy:
      raise ValueError(f"session_id={s!r} has a turn in flight")
  return sids
