"""Arithmetic with a calculator: "calc: 48213*937" -> call calculator -> "45175581".

Operands of `min_digits`..`max_digits` digits (as `arith`), drawn so that the exact answer is
out of reach of a tiny byte-level model without the tool: it learns to call
`calculator(expression=...)` and to copy the result (GLM-5, arXiv 2602.15763, section 3:
agentic RL with tool calls, here at toy scale). The SFT conversation is the tool-using
solution: user, an assistant turn that only calls the calculator, the observation (the
calculator's real output), the assistant's answer. The verifier is `arith`'s: the integer in
canonical decimal, exactly; answering without the tool is allowed and scored the same.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from glm5_jax.rl.envs.tasks import arith
from glm5_jax.rl.envs.tasks import problem as problem_lib

NAME = "tool_calc"
TOOLS = ("calculator",)
MAX_RESPONSE_BYTES = 32
PREFIX = "calc: "


@dataclasses.dataclass(frozen=True)
class Config:
  """min_digits, max_digits: operand length range (1..9); ops: operators to draw from."""
  min_digits: int = 3
  max_digits: int = 5
  ops: str = "+-*"

  def __post_init__(self):
    if isinstance(self.ops, (list, tuple)):
      object.__setattr__(self, "ops", "".join(self.ops))
    arith.Config(self.min_digits, self.max_digits, self.ops)   # same checks, same messages


def sample(rng: np.random.Generator, config: Config) -> problem_lib.Content:
  """Prompt "calc: <a><op><b>", answer str(a op b)."""
  c = arith.sample(rng, arith.Config(config.min_digits, config.max_digits, config.ops))
  return problem_lib.Content(PREFIX + c.prompt.rstrip("="), c.answer)


def solution_calls(problem) -> list[dict]:
  """The tool calls of the reference solution."""
  return [{"name": "calculator", "arguments": {"expression": problem.prompt[len(PREFIX):]}}]


check = problem_lib.exact_answer
