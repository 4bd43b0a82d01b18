"""Host-side bookkeeping of the paged KV cache: blocks, reference counts, cached prefixes.

The pool (nn/kv_cache.py) has `num_blocks` blocks of `block_size` rows. A request holds
the blocks its rows need (its block table); blocks are reference-counted so that equal
prompt prefixes share them:

  * a *full* block whose rows were computed under weight version v is registered under a
    chain key (v, hash of every token up to its end [, the token after it]); a later
    request whose prompt starts with the same tokens takes those blocks instead of
    prefilling them again (vLLM's automatic prefix caching works the same way);
  * shared blocks are full, so nobody writes them again: a request writes only from the
    end of its shared prefix on, into blocks of its own (the prompt's last, partial block
    is recomputed by each request rather than copied);
  * a registered block whose last holder leaves stays matchable until memory is needed:
    `allocate` takes free blocks first, then evicts such cached blocks least-recently
    released first.

With MTP speculative decoding the MTP pool's row j depends on token j + 1 as well, so the
key then covers the token after the block too (`lookahead=1`).
"""

from __future__ import annotations

import collections
from typing import Sequence


class BlockPool:
  """Free list, reference counts and the prefix index of `num_blocks` blocks."""

  def __init__(self, num_blocks: int, block_size: int, lookahead: int = 0, first: int = 0):
    """Blocks first .. first + num_blocks - 1 (a shard of the pool under a mesh)."""
    self.num_blocks, self.block_size, self.lookahead = num_blocks, block_size, lookahead
    self.first = first
    self.reset()

  def reset(self) -> None:
    """Every block free, no prefix cached (after a weight swap nothing cached is valid)."""
    self._free = collections.deque(range(self.first, self.first + self.num_blocks))
    self._ref = collections.defaultdict(int)
    self._key_of: dict[int, tuple] = {}
    self._by_key: dict[tuple, int] = {}
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

  @property
  def num_available(self) -> int:
    """Blocks `allocate` can hand out now (free + cached but unreferenced)."""
    return len(self._free) + len(self._evictable)

  def blocks_for(self, rows: int) -> int:
    return -(-rows // self.block_size)

  def allocate(self, n: int) -> list[int] | None:
    """n fresh blocks (reference count 1), or None (nothing changes) if there are fewer."""
    if n > self.num_available:
      return None
    out = []
    for _ in range(n):
      if self._free:
        b = self._free.popleft()
      else:
        b, _ = self._evictable.popitem(last=False)
        del self._by_key[self._key_of.pop(b)]
      self._ref[b] = 1
      out.append(b)
    return out

  def release(self, blocks: Sequence[int]) -> None:
    """Drops one reference to each block; unreferenced blocks become free or evictable."""
    for b in blocks:
      if self._ref[b] <= 0:
        raise AssertionError(f"block {b} released more often than held")
      self._ref[b] -= 1
      if self._ref[b] == 0:
        if b in self._key_of:
          self._evictable[b] = None
        else:
          self._free.append(b)

  def _keys(self, tokens: Sequence[int], version, n_blocks: int):
    bs, h = self.block_size, 0
    for j in range(n_blocks):
      h = hash((h, tuple(tokens[j * bs:(j + 1) * bs])))
      extra = tuple(tokens[(j + 1) * bs:(j + 1) * bs + self.lookahead])
      yield (version, h, extra)

  def lookup(self, tokens: Sequence[int], version, max_blocks: int) -> list[int]:
    """The longest run of cached blocks that starts `tokens` (at most max_blocks), each
    taken (reference count + 1)."""
    max_blocks = min(max_blocks, (len(tokens) - self.lookahead) // self.block_size)
    out = []
    for key in self._keys(tokens, version, max(max_blocks, 0)):
      b = self._by_key.get(key)
      if b is None:
        break
      if self._ref[b] == 0:
        del self._evictable[b]
      self._ref[b] += 1
      out.append(b)
    return out

  def register(self, tokens: Sequence[int], blocks: Sequence[int], version,
               n_rows: int) -> list[int]:
    """Makes the full blocks among the first n_rows rows of a request matchable; returns the
    blocks registered by this call (not those already cached)."""
    n_full = min(len(blocks), (min(n_rows, len(tokens) - self.lookahead)) // self.block_size)
    out = []
    for b, key in zip(blocks[:n_full], self._keys(tokens, version, n_full)):
      if b in self._key_of or key in self._by_key:
        continue
      self._key_of[b] = key
      self._by_key[key] = b
      out.append(b)
    return out

  def refcount(self, block: int) -> int:
    return self._ref[block]
