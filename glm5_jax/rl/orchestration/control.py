"""What the asynchronous trainer checkpoints besides its state: counters, prompts, the RNG.

`Control` is the item "control" of each orbax step (glm5_jax/rl/orchestration/async_loop.py):
update and version counters, consumed and admitted groups, the prompt cursor, the prompts to
re-admit first, the refill RNG, the ledger's length at the save and the metrics' running
totals. `Prompts` is the task's endless stream of training prompts the cursor indexes.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import orbax.checkpoint as ocp

from glm5_jax.rl.algorithm.seeds import seed_of


class Prompts:
  """The task's training prompts as an endless indexed stream (chunks of distinct draws)."""

  def __init__(self, task, seed: int, chunk: int = 512):
    self.task, self.seed, self.chunk = task, seed, chunk
    self._cache: dict = {}

  def __getitem__(self, index: int):
    c = index // self.chunk
    if c not in self._cache:
      self._cache = {c: self.task.problems("train", self.chunk,
                                           seed_of(self.seed, 7, c))}
    return self._cache[c][index % self.chunk]


class Control:
  """The trainer's counters and queues that a checkpoint holds (besides params, optimizer):
  also the ledger's length at the save (what a resume keeps of it, rl/orchestration/ledger.py) and
  the metrics' running totals (`totals`: counts, staleness histogram, wall, idle and compile
  time), which a resumed run continues from."""

  def __init__(self, seed: int):
    self.update = self.version = self.consumed = self.admitted = self.cursor = 0
    self.requeue: collections.deque = collections.deque()   # pristine prompt indices
    self.rng = np.random.default_rng(seed_of(seed, 11))
    self.ledger_lines: int | None = None      # None: a checkpoint from before the field
    self.totals: dict = {}

  def to_json(self, in_flight, ledger_lines: int, totals: dict) -> dict:
    return {"update": self.update, "version": self.version, "consumed": self.consumed,
            "admitted": self.admitted, "cursor": self.cursor,
            "requeue": list(self.requeue) + sorted(in_flight),
            "rng": self.rng.bit_generator.state, "ledger_lines": ledger_lines,
            "totals": totals}

  def load(self, d: dict):
    for f in ("update", "version", "consumed", "admitted", "cursor"):
      setattr(self, f, int(d[f]))
    self.requeue = collections.deque(int(i) for i in d["requeue"])
    self.rng.bit_generator.state = d["rng"]
    self.ledger_lines = d.get("ledger_lines")
    self.totals = d.get("totals") or {}


def read_control(workdir: str, update: int) -> dict:
  """The control state saved with checkpoint `update` of an asynchronous run (item
  "control": counters, prompt cursor, the prompts to re-admit first)."""
  with ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                             item_handlers={"control": ocp.JsonCheckpointHandler()}) as m:
    return m.restore(update, args=ocp.args.Composite(control=ocp.args.JsonRestore()))["control"]
