"""Integer arithmetic: "123*45=" -> "5535".

Two non-negative operands, each with a number of digits drawn uniformly from
[min_digits, max_digits] (then a value uniformly among the numbers of that many digits), and
an operator drawn uniformly from `ops` (+, - or *; a difference may be negative). The
difficulty knobs are the digit range and the operators: multi-digit products are what a
small model learns last (the verifiable-math rewards of GLM-5's reasoning RL, arXiv
2602.15763 section 3, reduced to what a byte-level model learns in minutes).

Answer format: the integer in canonical decimal, `-?(0|[1-9][0-9]*)` (no '+', no leading
zeros, no "-0", no separators, nothing else); the verifier compares the response with it
exactly after stripping leading and trailing whitespace (`problem.WHITESPACE`).
"""

from __future__ import annotations

import dataclasses
import operator
import re

import numpy as np

from glm5_jax.rl.envs.tasks import problem as problem_lib

NAME = "arith"
MAX_RESPONSE_BYTES = 32       # the longest answer (9-digit product, 18 digits) fits
MAX_DIGITS = 9
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclasses.dataclass(frozen=True)
class Config:
  """min_digits, max_digits: operand length range (1..9); ops: operators to draw from."""
  min_digits: int = 2
  max_digits: int = 4
  ops: str = "+-*"

  def __post_init__(self):
    if isinstance(self.ops, (list, tuple)) and all(isinstance(o, str) for o in self.ops):
      object.__setattr__(self, "ops", "".join(self.ops))   # ["+", "-"] from a config file
    if not (isinstance(self.min_digits, int) and isinstance(self.max_digits, int)
            and 1 <= self.min_digits <= self.max_digits <= MAX_DIGITS):
      raise ValueError(f"arith min_digits={self.min_digits}, max_digits={self.max_digits}: "
                       f"expected 1 <= min_digits <= max_digits <= {MAX_DIGITS}")
    ops = self.ops
    if not isinstance(ops, str) or not ops or not set(ops) <= set(OPS) or len(set(ops)) < len(ops):
      raise ValueError(f"arith ops={self.ops!r}: expected distinct operators from {''.join(OPS)!r}")


def _operand(rng: np.random.Generator, config: Config) -> int:
  digits = int(rng.integers(config.min_digits, config.max_digits + 1))
  lo = 0 if digits == 1 else 10**(digits - 1)
  return int(rng.integers(lo, 10**digits))


def sample(rng: np.random.Generator, config: Config) -> problem_lib.Content:
  """One problem: prompt "<a><op><b>=", answer str(a op b)."""
  op = config.ops[int(rng.integers(len(config.ops)))]
  a, b = _operand(rng, config), _operand(rng, config)
  return problem_lib.Content(f"{a}{op}{b}=", str(OPS[op](a, b)))


def reasoning(problem) -> str:
  """The column-by-column working of an addition, the SFT reasoning block: "37+45=" ->
  "7+5=12,3+4+1=8" (ones first, each column's digits, the carry, its sum; a missing digit is
  0). The answer is the last column's sum, then the earlier columns' last digits, backwards.
  """
  a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", problem.prompt).groups()
  if op != "+":
    raise ValueError(f"arith reasoning: problem {problem.id!r} ({problem.prompt!r}): worked "
                     "reasoning is written for '+' only; use ops='+' with think_fraction")
  width = max(len(a), len(b))
  a, b = a.zfill(width)[::-1], b.zfill(width)[::-1]
  steps, carry = [], 0
  for x, y in zip(a, b):
    total = int(x) + int(y) + carry
    steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
    carry = total // 10
  return ",".join(steps)


check = problem_lib.exact_answer
