"""String transformations: "reverse hello" -> "olleh", "sort hello" -> "ehllo",
"dedupe hello" -> "helo".

A lowercase string of length uniform in [min_len, max_len] over `alphabet`, and an operation
named in the prompt, drawn uniformly from `ops` (`OPS` below: reverse, sort the letters,
keep the first occurrence of each letter). Knobs: the length range, the operations, and
the alphabet (a small alphabet gives dedupe more repeats to remove).

Answer format: the transformed string, exactly (lowercase letters only); the verifier
strips leading and trailing whitespace (`problem.WHITESPACE`) and compares.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from glm5_jax.rl.envs.tasks import problem as problem_lib

NAME = "strings"
MAX_RESPONSE_BYTES = 48       # the longest answer (MAX_LEN letters) fits
MAX_LEN = 32
OPS = {
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
    "dedupe": lambda s: "".join(dict.fromkeys(s)),   # first occurrences, in order
}


@dataclasses.dataclass(frozen=True)
class Config:
  """min_len, max_len: string length range (1..32); ops: names from OPS; alphabet: letters."""
  min_len: int = 3
  max_len: int = 8
  ops: tuple[str, ...] = tuple(OPS)
  alphabet: str = string.ascii_lowercase

  def __post_init__(self):
    if not (isinstance(self.min_len, int) and isinstance(self.max_len, int)
            and 1 <= self.min_len <= self.max_len <= MAX_LEN):
      raise ValueError(f"strings min_len={self.min_len}, max_len={self.max_len}: expected "
                       f"1 <= min_len <= max_len <= {MAX_LEN}")
    ops = (self.ops,) if isinstance(self.ops, str) else self.ops
    ops = tuple(ops) if isinstance(ops, (list, tuple)) else ()
    if not ops or not set(ops) <= set(OPS) or len(set(ops)) != len(ops):
      raise ValueError(f"strings ops={self.ops!r}: expected distinct names from {tuple(OPS)}")
    object.__setattr__(self, "ops", ops)   # a list from a config file becomes a tuple
    a = self.alphabet
    if (not isinstance(a, str) or len(a) < 2 or not set(a) <= set(string.ascii_lowercase)
        or len(set(a)) != len(a)):
      raise ValueError(f"strings alphabet={a!r}: expected >= 2 distinct lowercase letters")


def sample(rng: np.random.Generator, config: Config) -> problem_lib.Content:
  """One problem: prompt "<op> <s>", answer OPS[op](s)."""
  op = config.ops[int(rng.integers(len(config.ops)))]
  n = int(rng.integers(config.min_len, config.max_len + 1))
  s = "".join(config.alphabet[i] for i in rng.integers(len(config.alphabet), size=n))
  return problem_lib.Content(f"{op} {s}", OPS[op](s))


check = problem_lib.exact_answer
