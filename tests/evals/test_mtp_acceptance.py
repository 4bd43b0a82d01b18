"""`evals.mtp_acceptance`: greedy acceptance lengths from per-position draft argmaxes."""

import numpy as np
import pytest

from glm5_jax.evals import mtp_acceptance


def _example():
  """10 tokens, prompt of 3 (token 3 comes from the prefill): MTP step 1 at position i
  predicts token i + 2, step 2 token i + 3. Right at positions 2 (both steps) and 6 (both
  steps); wrong elsewhere (token 0 never occurs)."""
  tokens = np.arange(10, 20)
  argmax_kt = np.zeros((2, 10), np.int64)
  argmax_kt[0, 2], argmax_kt[1, 2] = tokens[4], tokens[5]
  argmax_kt[0, 6], argmax_kt[1, 6] = tokens[8], tokens[9]
  return tokens, argmax_kt


@pytest.mark.parametrize("num_draft, want", [
    # D = 2: pos 3 keeps 2 drafts (+1: 3 tokens) -> pos 6 keeps none (1) -> pos 7 keeps 2,
    # cut to the 2 tokens left: 6 tokens in 3 rounds.
    (2, 6 / 3),
    # D = 1: 2 tokens at pos 3 -> 1 at pos 5 -> 1 at pos 6 -> 2 at pos 7: 6 in 4 rounds.
    (1, 6 / 4)])
def test_acceptance_length_counts_verified_rounds_and_cuts_the_last(num_draft, want):
  tokens, argmax_kt = _example()
  got = mtp_acceptance.greedy_acceptance_length(tokens, 3, num_draft, argmax_kt)
  assert got == pytest.approx(want)


def test_all_drafts_right_gives_d_plus_one_and_none_right_gives_one():
  tokens = np.arange(40)
  right = np.stack([np.roll(tokens, -(k + 2)) for k in range(3)])   # step k+1 at i: i + k + 2
  assert mtp_acceptance.greedy_acceptance_length(tokens, 3, 3, right) == pytest.approx(
      36 / 9)                                   # 36 tokens after the prefill's: 9 rounds of 4
  assert mtp_acceptance.greedy_acceptance_length(tokens, 3, 3, right * 0 - 1) == 1.0


@pytest.mark.parametrize("prompt_len", [0, 9, 10])
def test_a_prompt_without_tokens_after_the_prefill_is_refused(prompt_len):
  tokens, argmax_kt = _example()
  with pytest.raises(ValueError, match="prompt_len="):
    mtp_acceptance.greedy_acceptance_length(tokens, prompt_len, 2, argmax_kt)


def test_code_prompts_are_byte_windows_of_the_package_source():
  prompts = mtp_acceptance.code_prompts(4, 64, 0)
  assert len(prompts) == 4 and all(0 < len(p) <= 64 for p in prompts)
  assert all(0 <= t < 256 for p in prompts for t in p)
  assert prompts == mtp_acceptance.code_prompts(4, 64, 0)              # seeded
