"""Synthetic copy rows (glm5_jax/data/copy_task.py) against a per-token reading of the rule."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from glm5_jax.data import copy_task
from tests import paths


@pytest.mark.parametrize("seg_len,gap_len", [(6, 0), (5, 3), ((2, 9), (0, 4))])
def test_copied_tokens_repeat_an_earlier_segment(rng, seg_len, gap_len):
  tokens, copy = copy_task.make_rows(rng, 3, 97, seg_len=seg_len, gap_len=gap_len,
                                     vocab=(3, 50))
  assert tokens.shape == copy.shape == (3, 97) and tokens.dtype == np.int32
  assert tokens.min() >= 3 and tokens.max() < 50
  for r in range(3):
    # Walk the blocks by the rule: segment s, gap g, the segment again; the copy flags are the
    # second segment's tokens after its first.
    i, blocks = 0, 0
    while i < 97:
      # Find this block's (s, g): the unique pair in range whose copy matches.
      lo_s, hi_s = (seg_len, seg_len) if np.isscalar(seg_len) else seg_len
      lo_g, hi_g = (gap_len, gap_len) if np.isscalar(gap_len) else gap_len
      found = None
      for s in range(lo_s, hi_s + 1):
        for g in range(lo_g, hi_g + 1):
          n = min(2 * s + g, 97 - i)
          want = np.zeros(n, bool)
          want[s + g + 1:] = True
          ends = i + n == 97 or not copy[r, i + n]     # the next block starts unflagged
          if ends and np.array_equal(copy[r, i:i + n], want[:n]):
            src = tokens[r, i:i + s]
            dst = tokens[r, i + s + g:i + min(2 * s + g, 97 - i)]
            if np.array_equal(dst, src[:len(dst)]):
              found = n
              break
        if found:
          break
      assert found, f"row {r}: no segment/gap/copy block at {i}"
      i += found
      blocks += 1
    assert blocks >= 2


def test_fixed_lengths_put_every_copy_the_same_distance_after_its_source(rng):
  tokens, copy = copy_task.make_rows(rng, 4, 128, seg_len=10, gap_len=3)
  for r in range(4):
    for i in np.flatnonzero(copy[r]):
      assert tokens[r, i] == tokens[r, i - 13]
      assert not copy[r, i - 13]


def test_copy_accuracy_is_one_for_an_oracle_and_zero_one_token_late(rng):
  tokens, copy = copy_task.make_rows(rng, 2, 64, seg_len=(4, 8), gap_len=(0, 3))
  oracle = np.roll(tokens, -1, axis=1)               # pred[:, i] = tokens[:, i + 1]
  assert copy_task.copy_accuracy(oracle, tokens, copy) == 1.0
  assert copy_task.copy_accuracy(tokens, tokens, copy) == pytest.approx(
      (tokens[:, :-1] == tokens[:, 1:])[copy[:, 1:]].mean())


@pytest.mark.parametrize("kw,field", [(dict(seg_len=1), "seg_len"), (dict(seg_len=(5, 3)),
                                      "seg_len"), (dict(gap_len=-1), "gap_len"),
                                      (dict(vocab=(10, 10)), "vocab")])
def test_bad_lengths_are_refused_by_name(rng, kw, field):
  with pytest.raises(ValueError, match=field):
    copy_task.make_rows(rng, 1, 16, **kw)


def _train_copy(tmp_path, *flags):
  return subprocess.run([sys.executable, "-m", "experiments.train_copy", f"--out={tmp_path}",
                         *flags], capture_output=True, text=True, timeout=600,
                        cwd=paths.ROOT)


def test_train_copy_refuses_an_unknown_override_by_name(tmp_path):
  p = _train_copy(tmp_path, "--config.model.hidden_size=128", "--config.model.no_such_field=3")
  assert p.returncode != 0 and "no_such_field" in p.stderr


@pytest.mark.slow
def test_train_copy_trains_and_scores_both_kinds(tmp_path):
  p = _train_copy(tmp_path, "--config.total_steps=2", "--config.copy.eval_every=1",
                  "--config.copy.eval_rows=2", "--config.batch_size=2", "--config.seq_len=64")
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "copy_task.json") as f:
    result = json.load(f)
  assert result["steps"] == [0, 1, 2]
  for kind in ("position", "content"):
    assert all(0.0 <= a <= 1.0 for a in result[f"{kind}_accuracy"])
  assert result["loss"][0] is None and np.isfinite(result["loss"][1:]).all()
  assert (tmp_path / "copy_task.png").exists()
