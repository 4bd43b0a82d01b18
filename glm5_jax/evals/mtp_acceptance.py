"""How many MTP drafts greedy speculative decoding would accept, from one trainer forward.

The trainer's forward runs the shared MTP layer as training does (nn/model.py): step k at
position i takes token i + k and step k - 1's hidden state at i, and attends over step k's
own states at earlier positions. Speculative decoding with drafts that follow these
per-step semantics would, at a round whose pending token sits at position N, draft
d_k = argmax mtp_logits[k - 1, N - 1] for k = 1..D. Draft k only matters when drafts
1..k-1 were accepted, i.e. equal to the greedy tokens, so the forward over the final greedy
sequence gives exactly the drafts such an engine would make: the acceptance length of the
per-step semantics without building its D draft caches. The engine's drafts (a chained
EAGLE-style draft cache, inference/steps.py) are measured by running the engine; with D = 1
the two are the same computation.
"""

from __future__ import annotations

import pathlib

import numpy as np

from glm5_jax.data import tokenizers


def code_prompts(n: int, length: int, seed: int) -> list:
  """n byte-tokenizer prompts of `length` ids (fewer for a shorter file), each a random
  window of one of this package's own Python files: natural text that the tiny model,
  pretrained on the Python standard library, has not seen. For decoding measurements."""
  tok = tokenizers.get_tokenizer("bytes")
  files = sorted(pathlib.Path(__file__).resolve().parents[1].rglob("*.py"))
  rng = np.random.default_rng(seed)
  out = []
  for f in rng.choice(files, n, replace=False):
    ids = tok.encode(f.read_text())
    i = int(rng.integers(0, max(len(ids) - length, 1)))
    out.append(ids[i:i + length].tolist())
  return out


def greedy_acceptance_length(tokens, prompt_len: int, num_draft: int, draft_argmax_kt) -> float:
  """Tokens emitted per verify round (1 + accepted drafts) of greedy speculative decoding.

  Args:
    tokens: int [T], the prompt followed by the greedy continuation.
    prompt_len: P; token P (the first generated one) comes from the prefill, as in the
      engine, and is not counted.
    num_draft: D drafts per round.
    draft_argmax_kt: int [>= D, T]; row k - 1 is MTP step k's argmax at each position
      (its prediction of token i + k + 1).

  Returns:
    mean tokens per round over the rounds that generate tokens P + 1 .. T - 1 (the last
    round is cut at the end of the sequence, as the engine cuts it at the budget).
  """
  tokens = np.asarray(tokens)
  t, pos, rounds, emitted = len(tokens), prompt_len, 0, 0
  if not 0 < prompt_len < t - 1:
    raise ValueError(f"prompt_len={prompt_len}: expected 0 < prompt_len < len(tokens) - 1 "
                     f"= {t - 1} (at least one token after the prefill's)")
  while pos < t - 1:
    n = 0
    while (n < num_draft and pos + n + 1 < t
           and draft_argmax_kt[n][pos - 1] == tokens[pos + n + 1]):
      n += 1
    e = min(n + 1, t - 1 - pos)
    rounds, emitted, pos = rounds + 1, emitted + e, pos + e
  return emitted / rounds
