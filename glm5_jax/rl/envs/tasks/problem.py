"""Problems of a verifiable task, their train / held-out split, and SFT conversations.

A task draws problems at random (`sample(rng) -> Content`); which split a problem belongs
to is a property of its content, never of the draw: a hash of (task name, prompt) puts
`HELDOUT_FRACTION` of all possible problems in "heldout" and the rest in "train". `draw`
keeps the problems of the asked split and rejects the others, so no held-out problem can
appear in training data for any seed or any task option: held-out accuracy measures
generalisation, not memorisation.

An SFT conversation is a JSON record {"id", "messages": [system?, user, assistant]}, the
assistant turn carrying `reasoning: None` (thinking off: an empty reasoning block when
rendered in the GLM chat format; GLM-5, arXiv 2602.15763, section 3: turn-level thinking).
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from typing import Callable, NamedTuple

import numpy as np

SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1
_DRAWS_PER_PROBLEM = 50   # rejection budget of `draw`: 50 n + 1000 draws
WHITESPACE = " \t\r\n"   # what verifiers strip from both ends of a response; none inside


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: what the model is asked and what a verifier needs to judge it.

  id: "<task>-<split>-<index:05d>", the index within one `draw`.
  prompt: the user message.
  answer: the reference answer (the SFT target; the expected text for exact-match tasks).
  tests: hidden tests, never shown to the model: (arguments repr, expected result repr)
    pairs for python_functions, () elsewhere.
  """
  id: str
  task: str
  split: str
  prompt: str
  answer: str
  tests: tuple[tuple[str, str], ...] = ()


class Content(NamedTuple):
  """What a task's `sample` draws: a problem without its id and split."""
  prompt: str
  answer: str
  tests: tuple[tuple[str, str], ...] = ()


def split_of(task: str, prompt: str) -> str:
  """"heldout" for HELDOUT_FRACTION of all (task, prompt) pairs, by hash; "train" otherwise."""
  digest = hashlib.blake2b(f"{task}\0{prompt}".encode("utf-8"), digest_size=8).digest()
  return "heldout" if int.from_bytes(digest, "big") < HELDOUT_FRACTION * 2**64 else "train"


def draw(task: str, sample: Callable[[np.random.Generator], Content], split: str, n: int,
         seed: int) -> list[Problem]:
  """n distinct problems (distinct prompts) of `split`, the same list for the same seed.

  Draws with a generator seeded by (task, split, seed) and keeps the draws whose prompt
  hashes to `split` and has not been kept yet.
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: expected one of {SPLITS}")
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
    raise ValueError(f"n={n!r}: expected an integer >= 0")
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
    raise ValueError(f"seed={seed!r}: expected an integer >= 0")
  rng = np.random.default_rng([zlib.crc32(task.encode()), SPLITS.index(split), int(seed)])
  kept: dict[str, Content] = {}
  budget = _DRAWS_PER_PROBLEM * n + 1000
  for _ in range(budget):
    if len(kept) == n:
      break
    c = sample(rng)
    if c.prompt not in kept and split_of(task, c.prompt) == split:
      kept[c.prompt] = c
  if len(kept) < n:
    raise ValueError(f"task {task!r}: only {len(kept)} distinct {split} problems in {budget} "
                     f"draws, asked for n={n}; the task's options allow too few problems "
                     "(widen them, e.g. more digits or longer strings)")
  return [Problem(f"{task}-{split}-{i:05d}", task, split, *c) for i, c in enumerate(kept.values())]


def exact_answer(problem: Problem, response: str) -> float:
  """1.0 when `response` less leading / trailing WHITESPACE is exactly the reference answer."""
  return float(response.strip(WHITESPACE) == problem.answer)


def prompt_messages(problem: Problem, *, system: str | None = None) -> list[dict]:
  """The conversation up to the assistant's turn: [system?, user]."""
  head = [] if system is None else [{"role": "system", "content": system}]
  return head + [{"role": "user", "content": problem.prompt}]


def sft_record(problem: Problem, *, system: str | None = None) -> dict:
  """{"id", "messages": [system?, user, assistant]}, the reference answer with thinking off."""
  answer = {"role": "assistant", "content": problem.answer, "reasoning": None}
  return {"id": problem.id, "messages": prompt_messages(problem, system=system) + [answer]}
