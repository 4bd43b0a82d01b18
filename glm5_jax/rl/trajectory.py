"""Trajectories: token provenance from the rollout engine to the loss (TITO).

A `Trajectory` is one sampled response exactly as the engine produced it: the prompt's
token ids, the generated ids (stop token included), the raw-policy log-prob the engine
computed for each generated id, and the weight version that produced it. Nothing between
sampling and the loss turns tokens into text and back: the text of a response is decoded
only to score it.

`make_batch` right-pads trajectories into one `TrajectoryBatch` of `[b, t]` arrays, every
per-token array aligned with `tokens` (entry `[i, t]` is about token `t` of row `i`):

  tokens        int32    prompt ids then response ids, 0 after the row's end
  positions     int32    0 .. n-1 (RoPE positions; the engine uses the same)
  segment_ids   int32    1 on the row's tokens, 0 on padding (attention never reaches padding)
  loss_mask     float32  1 on response tokens (what the policy produced), else 0
  rollout_logp  float32  the engine's log pi(token_t | tokens_<t) on response tokens, else 0
  versions      int32    weight version that sampled each response token, -1 elsewhere
and per row: group_ids, rewards, advantages.

Notation: b rows, t padded length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np


@dataclasses.dataclass
class Trajectory:
  """One response sampled for one prompt of a group."""
  prompt_ids: Sequence[int]
  response_ids: Sequence[int]
  rollout_logp: Sequence[float]        # one per response id
  version: int                         # weight version that sampled it
  group_id: int
  reward: float = 0.0
  finish_reason: str = ""              # engine's: "stop" | "length" | "cache_full"
  topk: dict | None = None             # engine's DSA top-k {position: int32 [L, K]}
  error: str | None = None             # the reward function failed (environment failure)

  def __post_init__(self):
    if len(self.response_ids) != len(self.rollout_logp):
      raise ValueError(f"Trajectory: {len(self.response_ids)} response ids but "
                       f"{len(self.rollout_logp)} rollout log-probs")
    if not len(self.prompt_ids) or not len(self.response_ids):
      raise ValueError("Trajectory: prompt and response must both be non-empty")

  @property
  def length(self) -> int:
    return len(self.prompt_ids) + len(self.response_ids)


class TrajectoryBatch(NamedTuple):
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray
  rollout_logp: np.ndarray
  versions: np.ndarray
  group_ids: np.ndarray
  rewards: np.ndarray
  advantages: np.ndarray

  def rows(self, idx) -> "TrajectoryBatch":
    """The rows `idx` of every field (a minibatch)."""
    return TrajectoryBatch(*(f[idx] for f in self))


def bucket_length(n: int, minimum: int = 16) -> int:
  """Padded length for n tokens: the next power of two >= minimum (few distinct shapes, few
  compilations)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def make_batch(trajs: Sequence[Trajectory], advantages, *, length: int | None = None
               ) -> TrajectoryBatch:
  """Right-pads `trajs` into a TrajectoryBatch; `advantages` has one value per trajectory.

  length: padded length (default `bucket_length` of the longest row).
  """
  if not trajs:
    raise ValueError("make_batch: no trajectories")
  advantages = np.asarray(advantages, np.float32)
  if advantages.shape != (len(trajs),):
    raise ValueError(f"make_batch: advantages of shape {advantages.shape}, expected "
                     f"({len(trajs)},)")
  longest = max(tr.length for tr in trajs)
  t = bucket_length(longest) if length is None else length
  if t < longest:
    raise ValueError(f"make_batch: length={t} < the longest trajectory ({longest} tokens)")
  b = len(trajs)
  tokens = np.zeros((b, t), np.int32)
  seg = np.zeros((b, t), np.int32)
  mask = np.zeros((b, t), np.float32)
  logp = np.zeros((b, t), np.float32)
  versions = np.full((b, t), -1, np.int32)
  for i, tr in enumerate(trajs):
    p, n = len(tr.prompt_ids), tr.length
    tokens[i, :p] = tr.prompt_ids
    tokens[i, p:n] = tr.response_ids
    seg[i, :n] = 1
    mask[i, p:n] = 1.0
    logp[i, p:n] = tr.rollout_logp
    versions[i, p:n] = tr.version
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  return TrajectoryBatch(
      tokens=tokens, positions=positions, segment_ids=seg, loss_mask=mask, rollout_logp=logp,
      versions=versions, group_ids=np.asarray([tr.group_id for tr in trajs], np.int32),
      rewards=np.asarray([tr.reward for tr in trajs], np.float32), advantages=advantages)
