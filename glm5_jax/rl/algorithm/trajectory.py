"""Trajectories: token provenance from the rollout engine to the loss (TITO).

A `Trajectory` is ONE SEGMENT of one rollout (GLM-5 paper §3: tokens in, tokens out), held
as token-aligned lists: every id of the segment's row in order (prompt, sampled tokens,
observation tokens, ...), and per token whether the policy sampled it in this segment (the
loss mask), the engine's raw log-prob of it and the weight version that sampled it. Nothing
between sampling and the loss turns tokens into text and back: text is decoded only to
score a response or to run a tool. A single-turn response is one segment
(`Trajectory.from_response`); a multi-turn episode is one segment until a context rewrite
(keep-recent-k, discard-all) starts the next, whose re-rendered prompt carries no loss.

Ids: rollout id `f"{group_id}/{j}"` (sample j of a group), trajectory id
`f"{rollout_id}#{segment_id}"`; a refill copy has its own rollout id and `copy_of` = the
rollout id it copies (`glm5_jax/rl/algorithm/groups.py`). Every segment carries its rollout's status
(one of STATUSES) and reward.

`make_batch` right-pads trajectories into one `TrajectoryBatch` of `[b, t]` arrays, every
per-token array aligned with `tokens` (entry `[i, t]` is about token `t` of row `i`):

  tokens        int32    the segment's ids, 0 after the row's end
  positions     int32    0 .. n-1 (RoPE positions; the engine uses the same)
  segment_ids   int32    1 on the row's tokens, 0 on padding (attention never reaches padding)
  loss_mask     float32  1 on tokens the policy sampled in this segment, else 0
  rollout_logp  float32  the engine's log pi(token_t | tokens_<t) on loss tokens, else 0
  versions      int32    weight version that sampled each loss token, -1 elsewhere
  routing       int32    [b, t, L_moe, K] the experts the engine routed each token to (its
                         records; -1 where none), or None when no trajectory has records
and per row: group_ids (int group ids as they are; string ids numbered 0, 1, ... in order of
first appearance), rewards, advantages.

Notation: b rows, t padded length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

STATUSES = ("ok", "env_error", "timeout", "truncated", "aborted")


@dataclasses.dataclass
class Trajectory:
  """One segment of one rollout, as token-aligned lists (module docstring)."""
  tokens: list[int]
  loss_mask: list[float]               # 1.0 on tokens sampled in this segment, else 0.0
  rollout_logp: list[float]            # engine's raw log-prob on loss tokens, 0.0 elsewhere
  versions: list[int]                  # weight version of each loss token, -1 elsewhere
  rollout_id: str = ""
  group_id: int | str = 0
  segment_id: int = 0
  status: str = "ok"                   # one of STATUSES
  reward: float = 0.0                  # the rollout's reward; every segment carries it
  copy_of: str | None = None           # refill copies: the rollout id copied
  finish_reason: str = ""              # engine's: "stop" | "length" | "cache_full"
  topk: dict | None = None             # engine's DSA top-k {position: int32 [L, K]}
  routing: dict | None = None          # engine's MoE experts {position: int32 [L_moe, K]}
  error: str | None = None             # what failed (reward function, environment)
  prompt_index: int = -1               # the prompt cursor position it was drawn at

  def __post_init__(self):
    n = len(self.tokens)
    if not n:
      raise ValueError(f"Trajectory {self.id}: no tokens")
    for name in ("loss_mask", "rollout_logp", "versions"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"Trajectory {self.id}: {n} tokens but {len(getattr(self, name))} "
                         f"{name} entries (one per token)")
    if self.status not in STATUSES:
      raise ValueError(f"Trajectory {self.id}: status={self.status!r}, expected one of "
                       f"{STATUSES}")
    mask = np.asarray(self.loss_mask, np.float64)
    if not np.isin(mask, (0.0, 1.0)).all():
      raise ValueError(f"Trajectory {self.id}: loss_mask must be 0.0 or 1.0 per token")
    if mask[0]:
      raise ValueError(f"Trajectory {self.id}: token 0 is a loss token; a loss token needs "
                       "the tokens before it as context (start the segment with its prompt)")
    if (np.asarray(self.versions)[mask > 0] < 0).any():
      raise ValueError(f"Trajectory {self.id}: a loss token has version < 0; every sampled "
                       "token carries the weight version that sampled it")

  @classmethod
  def from_response(cls, prompt_ids: Sequence[int], response_ids: Sequence[int],
                    rollout_logp: Sequence[float], version: int | Sequence[int],
                    **meta) -> "Trajectory":
    """The single-turn segment: `prompt_ids` (no loss) then the sampled `response_ids`.

    version: the weight version of every response token (int) or one per response token
    (an engine that swapped weights mid-response). meta: the other fields.
    """
    p, r = len(prompt_ids), len(response_ids)
    if r != len(rollout_logp):
      raise ValueError(f"Trajectory.from_response: {r} response ids but "
                       f"{len(rollout_logp)} rollout log-probs")
    if not p or not r:
      raise ValueError("Trajectory.from_response: prompt and response must both be non-empty")
    versions = [int(version)] * r if np.ndim(version) == 0 else [int(v) for v in version]
    if len(versions) != r:
      raise ValueError(f"Trajectory.from_response: {len(versions)} versions for {r} "
                       "response ids (give one int or one per response id)")
    return cls(tokens=[int(x) for x in prompt_ids] + [int(x) for x in response_ids],
               loss_mask=[0.0] * p + [1.0] * r,
               rollout_logp=[0.0] * p + [float(x) for x in rollout_logp],
               versions=[-1] * p + versions, **meta)

  @property
  def length(self) -> int:
    return len(self.tokens)

  @property
  def id(self) -> str:
    return f"{self.rollout_id}#{self.segment_id}"

  @property
  def num_loss_tokens(self) -> int:
    return int(np.sum(np.asarray(self.loss_mask) > 0))

  def _loss_versions(self) -> np.ndarray:
    return np.asarray(self.versions)[np.asarray(self.loss_mask) > 0]

  @property
  def oldest_version(self) -> int | None:
    v = self._loss_versions()
    return int(v.min()) if v.size else None

  @property
  def newest_version(self) -> int | None:
    v = self._loss_versions()
    return int(v.max()) if v.size else None

  @property
  def valid(self) -> bool:
    return self.status == "ok"


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
  routing: np.ndarray | None = None

  def rows(self, idx) -> "TrajectoryBatch":
    """The rows `idx` of every field (a minibatch)."""
    return TrajectoryBatch(*(None if f is None else f[idx] for f in self))


def routing_bytes(tr: Trajectory) -> int:
  """Bytes of a trajectory's routing records (int32 [L_moe, K] per recorded position)."""
  return int(sum(np.asarray(x).nbytes for x in (tr.routing or {}).values()))


def routing_bytes_per_token(trajs: Sequence[Trajectory]) -> float:
  """Bytes the engine's routing records take per recorded token."""
  n = sum(len(tr.routing or {}) for tr in trajs)
  return sum(routing_bytes(tr) for tr in trajs) / n if n else 0.0


def routing_array(trajs: Sequence[Trajectory], t: int) -> np.ndarray | None:
  """int32 [b, t, L_moe, K]: each row's recorded experts, -1 where a position has none (it
  routes as usual under replay); None when no trajectory has records."""
  first = next((x for tr in trajs for x in (tr.routing or {}).values()), None)
  if first is None:
    return None
  out = np.full((len(trajs), t) + np.shape(first), -1, np.int32)
  for i, tr in enumerate(trajs):
    for pos, x in (tr.routing or {}).items():
      if pos < t:
        out[i, pos] = x
  return out


def bucket_length(n: int, minimum: int = 16) -> int:
  """Padded length for n tokens: the next power of two >= minimum (few distinct shapes, few
  compilations)."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def group_indices(trajs: Sequence[Trajectory]) -> np.ndarray:
  """int32 [b]: int group ids as they are; otherwise 0, 1, ... in order of first appearance."""
  ids = [tr.group_id for tr in trajs]
  if all(isinstance(g, (int, np.integer)) for g in ids):
    return np.asarray(ids, np.int32)
  first = {}
  return np.asarray([first.setdefault(g, len(first)) for g in ids], np.int32)


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
    n = tr.length
    tokens[i, :n] = tr.tokens
    seg[i, :n] = 1
    m = np.asarray(tr.loss_mask, np.float32)
    mask[i, :n] = m
    logp[i, :n] = np.where(m > 0, np.asarray(tr.rollout_logp, np.float32), 0.0)
    versions[i, :n] = np.where(m > 0, np.asarray(tr.versions, np.int32), -1)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  return TrajectoryBatch(
      tokens=tokens, positions=positions, segment_ids=seg, loss_mask=mask, rollout_logp=logp,
      versions=versions, group_ids=group_indices(trajs),
      rewards=np.asarray([tr.reward for tr in trajs], np.float32), advantages=advantages,
      routing=routing_array(trajs, t))
