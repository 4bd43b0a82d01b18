"""The host side of the engine's device calls: slots packed into lanes, outputs read back.

A device call (steps.py) runs over lanes, the rows of its batch. `Packer.lanes` chooses
which slot each lane runs: the participating slots packed into a power-of-two batch so that
idle slots cost nothing (padding lanes name slot `max_batch`), of at least `min_tokens`
tokens when batch-invariant (`invariant_tokens`); under a mesh lane i is slot i (a slot's
blocks live on its shard). Block tables are padded to a power-of-two bucket of blocks, so
that new lengths do not recompile. The `read_*` functions account a call's host copy of
its outputs to the requests of its lanes (records.Request.emit).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from glm5_jax import numerics


def invariant_tokens(cfg, platform: str = "cpu") -> int:
  """Fewest tokens per device call at which each row's result is independent of the others
  (engine.py's docstring): 8 on CPU (`numerics.MIN_INVARIANT_ROWS`; the MoE's CPU kernels
  run every token count); elsewhere max(2, ceil(E / K)) if any layer (or the MTP layer) is
  MoE (below it the MoE takes its gathered kernel), else 2."""
  if platform == "cpu":
    return numerics.MIN_INVARIANT_ROWS
  n_layers = cfg.num_hidden_layers + (1 if cfg.has_mtp else 0)
  if any(cfg.is_moe_layer(i) for i in range(n_layers)):
    return max(2, -(-cfg.n_routed_experts // cfg.num_experts_per_tok))
  return 2


def pow2(n: int) -> int:
  """The least power of two >= n (1 for n <= 1)."""
  return 1 << max(n - 1, 0).bit_length()


def prefill_buckets(chunk: int) -> list[int]:
  """Prefill chunk lengths: the powers of two from 16 below `chunk`, then `chunk`."""
  out, b = [], 16
  while b < chunk:
    out.append(b)
    b *= 2
  return out + [chunk]


def live(slots, lanes):
  """(lane, slot) of the lanes that run a slot (the others pad: slot len(slots))."""
  return [(i, b) for i, b in enumerate(lanes) if b < len(slots)]


class PrefillCall(NamedTuple):
  """The host arguments of one prefill call (steps.jit_steps' prefill), lane by lane."""
  lanes: np.ndarray       # int32 [n]: each lane's slot (max_batch: padding)
  table: np.ndarray       # int32 [n, m]
  tokens: np.ndarray      # int32 [n, t]
  start: np.ndarray       # int32 [n]
  n_valid: np.ndarray     # int32 [n]
  h_valid: np.ndarray     # bool [n]
  state: dict             # the lanes' decode state (`Packer.state`)


@dataclasses.dataclass
class Packer:
  """Shapes of an engine's device calls (`shape_buckets=False`: all `max_batch` lanes over
  the whole `max_table` view, so only the prefill chunk length varies)."""
  max_batch: int
  block_size: int
  num_blocks: int           # the padding entry of a block table: no block
  max_table: int            # blocks of the whole max_len view (a power of two)
  prefill_chunk: int
  min_tokens: int = 1       # fewest tokens per call (batch invariance)
  n_shards: int = 1
  shape_buckets: bool = True
  n_stop: int = 4           # stop-id columns of the decode state (grows, a power of two)

  def lanes(self, rows, t: int = 1) -> list[int]:
    """The slot of each lane of a call over slots `rows` with t tokens each."""
    if self.n_shards > 1:
      return [b if b in rows else self.max_batch for b in range(self.max_batch)]
    n = min(pow2(len(rows)), self.max_batch) if self.shape_buckets else self.max_batch
    n = max(n, pow2(-(-self.min_tokens // t)))
    return rows + [self.max_batch] * (n - len(rows))

  def table(self, slots, lanes, horizon: int) -> np.ndarray:
    """Block tables [lanes, m], m the power-of-two bucket of the blocks that rows
    0 .. horizon - 1 span (at least `horizon` rows: the call's queries)."""
    m = pow2(-(-horizon // self.block_size))
    if not self.shape_buckets:
      m = max(m, self.max_table)
    table = np.full((len(lanes), m), self.num_blocks, np.int32)
    for i, b in live(slots, lanes):
      blocks = slots[b].blocks[:m]
      table[i, :len(blocks)] = blocks
    return table

  def state(self, slots, lanes) -> dict:
    """Host-built decode state (steps.py) of each lane."""
    b = len(lanes)
    st = {"tok": np.zeros(b, np.int32), "pos": np.zeros(b, np.int32),
          "active": np.zeros(b, bool), "n_gen": np.zeros(b, np.int32),
          "budget": np.zeros(b, np.int32), "seed": np.zeros(b, np.int32),
          "req": np.zeros(b, np.int32), "temp": np.zeros(b, np.float32),
          "top_k": np.zeros(b, np.int32), "top_p": np.ones(b, np.float32),
          "stop": np.full((b, self.n_stop), -1, np.int32)}
    for i, slot in live(slots, lanes):
      r = slots[slot]
      sp = r.sampling
      st["tok"][i] = r.tokens[-1]
      st["pos"][i] = len(r.tokens) - 1 if r.sampled else len(r.tokens)
      st["active"][i] = r.active
      st["n_gen"][i], st["budget"][i] = len(r.gen), r.budget
      st["seed"][i], st["req"][i] = sp.seed, r.stream
      st["temp"][i], st["top_k"][i], st["top_p"][i] = sp.temperature, sp.top_k, sp.top_p
      st["stop"][i, :len(sp.stop_token_ids)] = sp.stop_token_ids
    return st

  def decode(self, slots, t: int, ahead: int):
    """(lanes, block tables, decode state) of a decode call over the decoding slots: t
    tokens per lane, rows up to `ahead` past each slot's cache."""
    rows = [b for b, r in enumerate(slots) if r is not None and r.decoding]
    lanes = self.lanes(rows, t)
    table = self.table(slots, lanes, max(slots[b].cache_len + ahead for b in rows))
    return lanes, table, self.state(slots, lanes)

  def prefill(self, slots) -> PrefillCall:
    """The next chunk (at most `prefill_chunk` tokens, a bucket of `prefill_buckets`) of
    every slot whose conversation is not cached yet."""
    rows = [b for b, r in enumerate(slots) if r is not None and r.prefilling]
    longest = max(slots[b].feed_end - slots[b].cache_len for b in rows)
    t = next(x for x in prefill_buckets(self.prefill_chunk)
             if x >= min(longest, self.prefill_chunk))
    lanes = self.lanes(rows, t)
    table = self.table(slots, lanes, max([t] + [slots[b].cache_len + t for b in rows]))
    n = len(lanes)
    tokens = np.zeros((n, t), np.int32)
    start, n_valid = np.zeros(n, np.int32), np.zeros(n, np.int32)
    h_valid = np.zeros(n, bool)
    for i, b in live(slots, lanes):
      r = slots[b]
      piece = r.tokens[r.cache_len:min(r.cache_len + t, r.feed_end)]
      tokens[i, :len(piece)] = piece
      start[i], n_valid[i], h_valid[i] = r.cache_len, len(piece), r.h_valid
    return PrefillCall(np.asarray(lanes, np.int32), table, tokens, start, n_valid, h_valid,
                       self.state(slots, lanes))


def read_prefill(call: PrefillCall, out, slots, version, stats) -> list:
  """Accounts a prefill call's outputs (host copies): rows cached, their records, and the
  first token of each request whose conversation is now cached. Returns the requests whose
  conversation is cached for the first time (their prefix blocks become shareable)."""
  cached = []
  for i, b in live(slots, call.lanes):
    r, n, start = slots[b], int(call.n_valid[i]), int(call.start[i])
    r.cache_len += n
    r.h_valid = True
    r.record(start, *(None if out.get(k) is None else out[k][:, i, :n].swapaxes(0, 1)
                      for k in ("topk", "routing")))
    if r.cache_len == r.feed_end and not r.prefilled:
      cached.append(r)
    if r.cache_len == r.feed_end and not r.sampled:
      r.emit(int(out["tok"][i]), float(out["logprob"][i]), r.cache_len - 1, version)
      stats["generated_tokens"] += 1
  stats["prefill_tokens"] += int(call.n_valid.sum())
  stats["prefill_calls"] += 1
  return cached


def read_decode(lanes, out, st, slots, version, stats) -> None:
  """Accounts a decode call's outputs (host copies): per step, each lane's emitted token."""
  for s in range(out["emit"].shape[0]):
    for i, b in live(slots, lanes):
      if out["emit"][s, i]:
        topk = None if out["topk"] is None else out["topk"][s, :, i]
        routing = None if out.get("routing") is None else out["routing"][s, :, i]
        slots[b].emit(int(out["tok"][s, i]), float(out["logprob"][s, i]),
                      int(out["pos"][s, i]), version, topk, routing)
        stats["generated_tokens"] += 1
  stats["decode_slot_steps"] += int(out["emit"].sum())
  stats["decode_steps"] += int(out["emit"].any(axis=1).sum())           # steps run
  _read_state(lanes, st, slots)


def read_speculative(lanes, out, st, slots, version, stats) -> None:
  """Accounts speculative rounds' outputs (host copies): per round, each lane's emitted
  tokens (accepted drafts + one target token) and its accepted drafts."""
  for k in range(out["n_emit"].shape[0]):
    for i, b in live(slots, lanes):
      r, e = slots[b], int(out["n_emit"][k, i])
      if not e:
        continue
      r.rounds += 1
      r.accepted += int(min(out["n_accepted"][k, i], e))
      for j in range(e):
        topk = None if out["topk"] is None else out["topk"][k, :, i, j]
        routing = None if out.get("routing") is None else out["routing"][k, :, i, j]
        r.emit(int(out["tok"][k, i, j]), float(out["logprob"][k, i, j]),
               int(out["pos"][k, i]) + j, version, topk, routing)
        stats["generated_tokens"] += 1
      stats["rounds"] += 1
      stats["decode_slot_steps"] += 1
  stats["decode_steps"] += int((out["n_emit"] > 0).any(axis=1).sum())   # rounds run
  _read_state(lanes, st, slots)


def _read_state(lanes, st, slots) -> None:
  """Each lane's cached rows and whether it still generates, from the call's final state."""
  for i, b in live(slots, lanes):
    r = slots[b]
    r.cache_len = int(st["pos"][i])
    r.active = bool(st["active"][i]) and r.active
