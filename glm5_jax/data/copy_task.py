"""Synthetic in-context copying: can a model learn to copy from its context at all?

Passkey retrieval (data/passkey.py) needs a model that finds an earlier occurrence of what it
is reading and copies what followed it: an induction head (Olsson et al. 2022, "In-context
Learning and Induction Heads"). These rows test that ability alone, without language:

    [segment][gap][segment] [segment'][gap'][segment'] ...     each token uniform in `vocab`

The second copy of a segment is predictable from its second token on (its first token follows
the random gap). With a fixed segment and gap length, every copied token sits exactly
`seg_len + gap_len` positions after its source, so a model can copy *by position* (one head
attending a fixed offset back, which RoPE makes easy). With lengths drawn per block the offset
changes from block to block and the model must copy *by content*: the mechanism retrieval
needs. Comparing the two separates "cannot copy" from "can only copy by position".

Notation: b rows, t positions.
"""

from __future__ import annotations

import numpy as np


def _range(name: str, value) -> tuple[int, int]:
  """An int n (always n) or an inclusive range (lo, hi) -> (lo, hi), checked."""
  lo, hi = (value, value) if np.isscalar(value) else tuple(value)
  if not 0 <= lo <= hi:
    raise ValueError(f"{name}={value!r}: expected an int >= 0 or a range (lo, hi), "
                     f"0 <= lo <= hi")
  return int(lo), int(hi)


def make_rows(rng: np.random.Generator, n: int, length: int, *, seg_len=(8, 48),
              gap_len=(0, 16), vocab=(32, 127)):
  """`n` rows of `length` tokens: blocks of segment + gap + the same segment, cut at `length`.

  seg_len, gap_len: an int (every block the same: copying by position works) or an inclusive
    range drawn per block (copying must be by content).
  vocab: token ids drawn uniformly from [vocab[0], vocab[1]).
  Returns (tokens int32 [n, length], copy_bt bool [n, length]); copy_bt[r, i] is True where
  tokens[r, i] is a copied token predictable from the context before it (the second copy's
  tokens after its first).
  """
  seg = _range("seg_len", seg_len)
  gap = _range("gap_len", gap_len)
  if seg[0] < 2:
    raise ValueError(f"seg_len={seg_len!r}: a segment needs >= 2 tokens to copy any")
  if not 0 <= vocab[0] < vocab[1]:
    raise ValueError(f"vocab={vocab!r}: expected token ids [lo, hi) with 0 <= lo < hi")
  tokens = np.zeros((n, length), np.int32)
  copy_bt = np.zeros((n, length), bool)
  for r in range(n):
    i = 0
    while i < length:
      s, g = rng.integers(seg[0], seg[1] + 1), rng.integers(gap[0], gap[1] + 1)
      block = rng.integers(vocab[0], vocab[1], s + g)
      row = np.concatenate([block, block[:s]])
      mask = np.zeros(len(row), bool)
      mask[s + g + 1:] = True
      m = min(len(row), length - i)
      tokens[r, i:i + m], copy_bt[r, i:i + m] = row[:m], mask[:m]
      i += m
  return tokens, copy_bt


def copy_accuracy(pred_bt, tokens_bt, copy_bt) -> float:
  """Fraction of copied tokens predicted: pred_bt[:, i] is the prediction of tokens_bt[:, i+1]
  (argmax of the logits at i), scored where copy_bt[:, i+1]."""
  hit = np.asarray(pred_bt)[:, :-1] == np.asarray(tokens_bt)[:, 1:]
  mask = np.asarray(copy_bt)[:, 1:]
  if not mask.any():
    raise ValueError("no copied tokens to score")
  return float(hit[mask].mean())
