"""DP-aware routing: rollout id -> rollout replica, sticky, by consistent hashing with bounded
loads (GLM-5 paper §3: every turn of an episode goes where its prefix is cached).

The rule (Mirrokni, Thorup & Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA
2018):

  1. Each active replica owns `vnodes` points on a hash ring; a rollout id hashes to a point.
     The hash is blake2b of the text (stable across processes and runs; Python's `hash()` of a
     str is salted per process and would scatter a rollout's turns).
  2. A new rollout id walks the ring clockwise from its point and takes the first replica
     whose load (rollouts assigned and not released) is below the cap
     ceil(load_bound * (total + 1) / active replicas), so no replica ever exceeds
     load_bound times the average when it takes a rollout.
  3. The assignment sticks until `release` (the episode ended) or until its replica is
     `remove`d (a dead worker): only that replica's ids re-route. `add` moves no assigned id;
     new ids hashing near the new replica's points go to it (about 1 / replicas of them).

`PrefixStats` counts the prompt tokens the engines found in their prefix cache.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import threading


def stable_hash(text: str) -> int:
  """64-bit blake2b of `text`: the same in every process and on every run."""
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Router:
  """Sticky rollout id -> replica assignment (module docstring). Thread-safe."""

  def __init__(self, replicas: int, load_bound: float = 1.25, seed: int = 0,
               vnodes: int = 64):
    if replicas < 1:
      raise ValueError(f"Router: replicas={replicas}, expected >= 1")
    if load_bound < 1.0:
      raise ValueError(f"Router: load_bound={load_bound}, expected >= 1.0 (a cap below the "
                       "average load cannot hold every rollout)")
    if vnodes < 1:
      raise ValueError(f"Router: vnodes={vnodes}, expected >= 1")
    self.load_bound, self.seed, self.vnodes = load_bound, seed, vnodes
    self._lock = threading.Lock()
    self._ring: list[tuple[int, int]] = []          # sorted (point, replica)
    self._load: dict[int, int] = {}
    self._owner: dict[str, int] = {}
    for r in range(replicas):
      self._add(r)

  def _points(self, replica: int) -> list[tuple[int, int]]:
    return [(stable_hash(f"{self.seed}/replica{replica}/{v}"), replica)
            for v in range(self.vnodes)]

  def _add(self, replica: int) -> None:
    for p in self._points(replica):
      bisect.insort(self._ring, p)
    self._load[replica] = 0

  def cap(self, total: int) -> int:
    """The most rollouts a replica may hold when `total` are assigned in all."""
    return math.ceil(self.load_bound * total / len(self._load))

  def _walk(self, rollout_id: str):
    start = bisect.bisect(self._ring, (stable_hash(f"{self.seed}/{rollout_id}"), -1))
    n = len(self._ring)
    for i in range(n):
      yield self._ring[(start + i) % n][1]

  def _assign(self, rollout_id: str) -> int:
    cap = self.cap(len(self._owner) + 1)
    for r in self._walk(rollout_id):
      if self._load[r] < cap:
        self._owner[rollout_id] = r
        self._load[r] += 1
        return r
    raise AssertionError("Router: no replica below the cap (cannot happen: cap * replicas "
                         "> rollouts assigned)")

  def home(self, rollout_id: str) -> int:
    """The replica the ring gives `rollout_id` ignoring loads (its first choice)."""
    with self._lock:
      return next(self._walk(rollout_id))

  def route(self, rollout_id: str) -> int:
    """The replica of `rollout_id`: its current one, or a new bounded-load assignment."""
    with self._lock:
      if not self._load:
        raise RuntimeError("Router.route: no active replica (all removed)")
      r = self._owner.get(rollout_id)
      return self._assign(rollout_id) if r is None else r

  def release(self, rollout_id: str) -> None:
    """The rollout ended: its replica's load drops (unknown ids are ignored)."""
    with self._lock:
      r = self._owner.pop(rollout_id, None)
      if r is not None:
        self._load[r] -= 1

  def remove(self, replica: int) -> dict[str, int]:
    """Takes `replica` off the ring; its rollouts re-route. Returns {rollout id: new replica}."""
    with self._lock:
      if replica not in self._load:
        raise ValueError(f"Router.remove: replica {replica} is not active "
                         f"(active: {sorted(self._load)})")
      self._ring = [p for p in self._ring if p[1] != replica]
      del self._load[replica]
      moved = sorted(i for i, r in self._owner.items() if r == replica)
      for i in moved:
        del self._owner[i]
      if not self._load:
        return {}
      return {i: self._assign(i) for i in moved}

  def add(self, replica: int) -> None:
    """Puts `replica` (back) on the ring; assigned rollouts stay where they are."""
    with self._lock:
      if replica in self._load:
        raise ValueError(f"Router.add: replica {replica} is already active")
      self._add(replica)

  def loads(self) -> dict[int, int]:
    """{active replica: rollouts assigned}."""
    with self._lock:
      return dict(sorted(self._load.items()))

  def assignments(self) -> dict[str, int]:
    with self._lock:
      return dict(self._owner)


class PrefixStats:
  """Prompt tokens found in the engines' prefix caches, over all requests (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.cached_tokens = 0
    self.prompt_tokens = 0

  def record(self, cached_tokens: int, prompt_tokens: int) -> None:
    if not 0 <= cached_tokens <= prompt_tokens:
      raise ValueError(f"PrefixStats.record: cached_tokens={cached_tokens}, expected in "
                       f"[0, prompt_tokens={prompt_tokens}]")
    with self._lock:
      self.cached_tokens += cached_tokens
      self.prompt_tokens += prompt_tokens

  @property
  def hit_rate(self) -> float:
    """Cached / prompt tokens (0.0 before any request)."""
    with self._lock:
      return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
