"""The engine's host scheduler: which waiting request runs in which slot, on which cache blocks.

Pure Python over the request records (records.py) and the block pools (paging.py); nothing
here touches a device. `admit` decides and returns its decisions (`Admission`); the engine
applies what they need on the device (a session's MTP hidden state into its slot's row).

Admission, first come first served, while a slot is free:
  1. a copy of an n-copy submit whose leader has not finished its prompt waits for it (so
     that it shares the leader's prompt blocks instead of prefilling them too);
  2. the slot: one on the shard that holds the request's blocks (its own, its session's,
     its leader's), else the free slot of the shard with the most available blocks (the
     lowest index on a tie);
  3. the blocks: a session's cached conversation, else the longest cached prefix of the
     prompt (keeping one token to prefill), then fresh blocks for the rest of the prompt and
     the whole budget, evicting idle sessions least recently used first; if they do not fit,
     admission stops until a request finishes.
With `scheduling="static"` nothing is admitted while any slot is busy (the baseline).

Sharded serving: slots and blocks are split into `n_shards` equal ranges (slot i is on
shard i // (max_batch / n_shards)); a request's blocks are all on its slot's shard.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from glm5_jax.inference import paging
from glm5_jax.inference import records

SCHEDULING = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class Admission:
  """A waiting request admitted into a slot.

  Attributes:
    request: the request (now in `slot`, holding reused + fresh blocks).
    slot: its slot; shard: the pool shard of the slot and of its blocks.
    reused: blocks it took from the cache (its session's, a shared prefix's, or those
      kept from an earlier try), first in its block table; `request.cache_len` rows of
      them are cached.
    fresh: newly allocated blocks, after them.
    h_last: MTP: the session's main hidden state of row cache_len - 1 (host copy) for the
      engine to write into the slot's row; None if there is nothing to write.
  """
  request: records.Request
  slot: int
  shard: int
  reused: tuple
  fresh: tuple
  h_last: object = None


class Scheduler:
  """Slots, the waiting queue, sessions and the block pools of one engine."""

  def __init__(self, max_batch: int, num_blocks: int, block_size: int, *, n_shards: int = 1,
               scheduling: str = "continuous", speculative: bool = False, version=0,
               stats: collections.Counter | None = None):
    """speculative: the MTP pool's row j needs token j + 1 (prefix keys cover one token
    more, paging.py) and a session's MTP hidden state; version: the weight version under
    which rows are cached (prefixes are keyed by it); stats: counts `sessions_evicted`."""
    self.max_batch, self.block_size, self.n_shards = max_batch, block_size, n_shards
    self.scheduling, self.speculative, self.version = scheduling, speculative, version
    per_shard = num_blocks // n_shards
    self.pools = [paging.BlockPool(per_shard, block_size, lookahead=1 if speculative else 0,
                                   first=i * per_shard) for i in range(n_shards)]
    self.slots: list[records.Request | None] = [None] * max_batch
    self.waiting: collections.deque[records.Request] = collections.deque()
    self.requests: dict[int, records.Request] = {}
    self.sessions: dict[str, records.Session] = {}
    self.block_records: dict[int, list] = {}      # cached block -> its rows' (topk, routing)
    self.stats = collections.Counter() if stats is None else stats
    self._ids, self._session_ids, self._clock = (itertools.count() for _ in range(3))

  def shard_of(self, slot: int) -> int:
    return slot // (self.max_batch // self.n_shards)

  # ------------------------------------------------------------------ sessions
  def new_session(self) -> str:
    sid = f"session-{next(self._session_ids)}"
    self.sessions[sid] = records.Session(sid, last_used=next(self._clock))
    return sid

  def session(self, session_id) -> records.Session:
    """The open session `session_id`; a ValueError listing the open ones if unknown."""
    if session_id not in self.sessions:
      raise ValueError(f"session_id={session_id!r} is unknown; open sessions: "
                       f"{sorted(self.sessions)}")
    return self.sessions[session_id]

  def end_session(self, session_id: str) -> None:
    s = self.session(session_id)
    if s.busy:
      raise ValueError(f"end_session({session_id!r}): a turn is in flight; cancel it first")
    self.pools[s.shard].release(s.blocks)
    del self.sessions[session_id]

  # ------------------------------------------------------------------ requests
  def turn_session(self, session_id, n: int):
    """The session a submit of n copies continues (None without one): open, n = 1, no turn
    in flight."""
    if session_id is None:
      return None
    session = self.session(session_id)
    if n != 1:
      raise ValueError(f"submit: n={n} with session_id={session_id!r}; a session has one "
                       "conversation, expected n=1")
    if session.busy:
      raise ValueError(f"session_id={session_id!r} has a turn in flight; wait for it or "
                       "cancel it")
    return session

  def check_fits(self, total: int, budget: int) -> None:
    """A request of `total` conversation tokens and `budget` new ones fits an empty shard."""
    pool = self.pools[0]
    need = pool.blocks_for(total + budget - 1)
    if need > pool.num_blocks:
      raise ValueError(f"submit: {total} prompt tokens + {budget - 1} more rows need {need} "
                       f"blocks; the whole cache has num_blocks={pool.num_blocks * self.n_shards}"
                       f" of block_size={self.block_size}"
                       + (f" in {self.n_shards} shards" if self.n_shards > 1 else ""))

  def submit(self, tokens: list, sampling, budget: int, *, n: int = 1, session=None,
             stream: int = 0, record_topk: bool = False,
             record_routing: bool = False) -> list[int]:
    """Queues n copies of a request for `tokens` (a session's conversation + the prompt);
    copy j samples stream + j and shares copy 0's prompt blocks. Returns their ids."""
    ids = []
    for j in range(n):
      rid = next(self._ids)
      r = records.Request(rid, stream + j, sampling, session, record_topk, list(tokens),
                          budget, leader=ids[0] if ids else None,
                          topk={} if record_topk else None,
                          routing={} if record_routing else None)
      self.requests[rid] = r
      self.waiting.append(r)
      ids.append(rid)
    if session is not None:
      session.busy = True
    return ids

  def cancel(self, request_id: int) -> None:
    """Drops a waiting or running request and releases its blocks (a session keeps its
    conversation as it was before this turn)."""
    if request_id not in self.requests:
      raise ValueError(f"cancel: request_id={request_id!r} is unknown or already finished")
    r = self.requests.pop(request_id)
    if r.slot is not None:
      self.slots[r.slot] = None
    else:
      self.waiting.remove(r)
    if r.session is not None:
      s = r.session
      s.busy = False
      if r.blocks:                            # rows before the turn are unchanged
        s.blocks, s.cache_len = r.blocks, min(r.cache_len, len(s.tokens) - 1)
        s.h_last = None
      s.cache_len = min(s.cache_len, max(len(s.tokens) - 1, 0))
      s.shard = r.shard if r.blocks else s.shard
    else:
      self.pools[r.shard].release(r.blocks)

  def finish(self, r: records.Request, h_last=None) -> records.GenerationOutput:
    """Frees r's slot; its session keeps the blocks (and h_last, the MTP hidden state of
    its last cached row, a host copy), else they are released."""
    self.slots[r.slot] = None
    del self.requests[r.rid]
    if r.session is not None:
      s = r.session
      s.tokens, s.blocks, s.cache_len, s.shard = list(r.tokens), r.blocks, r.cache_len, r.shard
      s.h_last = h_last
      s.busy, s.last_used = False, next(self._clock)
    else:
      self.pools[r.shard].release(r.blocks)
    return r.output()

  def new_weights(self, version) -> None:
    """Nothing cached is valid under weights `version`: running requests go back to the
    front of the queue (in submission order), every request and session will prefill its
    rows again, every block is freed."""
    self.block_records = {}
    self.version = version
    running = sorted((r for r in self.slots if r is not None), key=lambda r: r.rid)
    for r in running:
      self.slots[r.slot] = None
      r.slot = None
    self.waiting.extendleft(reversed(running))
    for r in self.waiting:
      r.blocks, r.cache_len, r.h_valid = [], 0, False
    for s in self.sessions.values():
      s.blocks, s.cache_len, s.h_last = [], 0, None
    for pool in self.pools:
      pool.reset()

  # ------------------------------------------------------------------ admission
  def admit(self) -> list[Admission]:
    """Moves waiting requests into free slots (module docstring); returns the decisions."""
    if self.scheduling == "static" and any(r is not None for r in self.slots):
      return []
    out, deferred = [], []
    lookahead = self.pools[0].lookahead
    while self.waiting and None in self.slots:
      r = self.waiting[0]
      leader = self.requests.get(r.leader) if r.leader is not None else None
      if (leader is not None and not leader.prefilled
          and r.feed_end > self.block_size + lookahead):
        deferred.append(self.waiting.popleft())        # shares the leader's prompt blocks
        continue
      slot = self._pick_slot(r, leader)
      fresh = None if slot is None else self._reserve(r, self.shard_of(slot))
      if fresh is None:
        break
      self.waiting.popleft()
      r.slot = slot
      self.slots[slot] = r
      h_last = None
      if r.h_valid and r.session is not None and self.speculative and r.session.h_last is not None:
        h_last, r.session.h_last = r.session.h_last, None
      reused = r.blocks[:len(r.blocks) - len(fresh)]
      out.append(Admission(r, slot, r.shard, tuple(reused), tuple(fresh), h_last))
    self.waiting.extendleft(reversed(deferred))
    return out

  def _pick_slot(self, r: records.Request, leader):
    """A free slot for r: on the shard that holds its blocks (its own, its session's, its
    group leader's), else on the shard with the most available blocks."""
    free = [i for i, x in enumerate(self.slots) if x is None]
    held = r.shard if r.blocks else (r.session.shard if r.session and r.session.blocks
                                     else (leader.shard if leader is not None
                                           and leader.blocks else None))
    if held is not None:
      free = [i for i in free if self.shard_of(i) == held] or ([] if r.blocks else free)
    if not free:
      return None
    return max(free, key=lambda i: (self.pools[self.shard_of(i)].num_available, -i))

  def _reserve(self, r: records.Request, shard: int) -> list[int] | None:
    """Gives r the blocks (of `shard`) for its prompt and budget, shared prefix first;
    returns those newly allocated. None: not now (r keeps the cached blocks it took)."""
    pool = self.pools[shard]
    if r.session is not None and r.session.blocks and not r.blocks:
      s = r.session
      if s.shard == shard:
        r.blocks, r.cache_len = s.blocks, s.cache_len
        r.h_valid = not self.speculative or s.h_last is not None
        if not r.h_valid:                      # MTP row cache_len - 1 needs h: recompute it
          r.cache_len = max(r.cache_len - 1, 0)
      else:                                    # its shard is full: prefill it again here
        self.pools[s.shard].release(s.blocks)
      s.blocks, s.cache_len = [], 0
      r.cached_prompt = r.cache_len
    if not r.blocks:
      max_shared = (r.feed_end - 1) // self.block_size         # keep a token to prefill
      r.blocks = pool.lookup(r.tokens, self.version, max_shared)
      r.cache_len = len(r.blocks) * self.block_size
      r.cached_prompt, r.h_valid = r.cache_len, False
      self._recall(r)
    r.shard = shard
    rows = len(r.tokens) + (r.budget - len(r.gen)) - 1
    fresh = self._allocate(pool.blocks_for(rows) - len(r.blocks), r.session, shard)
    if fresh is not None:
      r.blocks = r.blocks + fresh
    return fresh

  def _allocate(self, n, keep, shard):
    """n blocks of `shard`, evicting its idle sessions least recently used first if needed."""
    pool = self.pools[shard]
    fresh = pool.allocate(max(n, 0))
    idle = sorted((s for s in self.sessions.values() if s is not keep and not s.busy
                   and s.blocks and s.shard == shard), key=lambda s: s.last_used)
    while fresh is None and idle:
      s = idle.pop(0)
      pool.release(s.blocks)
      s.blocks, s.cache_len, s.h_last = [], 0, None
      self.stats["sessions_evicted"] += 1
      fresh = pool.allocate(max(n, 0))
    return fresh

  # ------------------------------------------------------------------ cached prefixes
  def prompt_cached(self, r: records.Request) -> None:
    """r's conversation is in the cache: its full blocks become matchable prefixes, keeping
    the records (top-k, routing) of their rows for the requests that will share them."""
    r.prefilled = True
    pool = self.pools[r.shard]
    blocks = pool.register(r.tokens, r.blocks, self.version, r.cache_len - pool.lookahead)
    if r.topk is None and r.routing is None:
      return
    pos = {b: j * self.block_size for j, b in enumerate(r.blocks)}
    for b in blocks:
      rows = range(pos[b], pos[b] + self.block_size)
      self.block_records[b] = [((r.topk or {}).get(p), (r.routing or {}).get(p)) for p in rows]

  def _recall(self, r: records.Request) -> None:
    """Fills r's records of the rows it took from cached blocks (`prompt_cached`)."""
    if r.topk is None and r.routing is None:
      return
    for j, b in enumerate(r.blocks):
      for i, (topk, routing) in enumerate(self.block_records.get(b, ())):
        p = j * self.block_size + i
        if r.topk is not None and topk is not None:
          r.topk.setdefault(p, topk)
        if r.routing is not None and routing is not None:
          r.routing.setdefault(p, routing)
