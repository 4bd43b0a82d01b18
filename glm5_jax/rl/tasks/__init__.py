"""Verifiable tasks for reasoning RL on a small model, chosen by name (`config.rl.task`).

  task = tasks.get("arith", max_digits=3)     # options: the fields of arith.Config
  train = task.problems("train", 1000, seed=0)
  evals = task.problems("heldout", 500, seed=0)   # never overlaps any train draw
  task.write_sft("/tmp/arith.jsonl", 5000, seed=0)  # SFT conversations (train split)
  r = rewards.get("arith")(evals[0], "5535", truncated=False)

Tasks (one module each): `arith` (integer +, -, *), `strings` (reverse / sort / dedupe a
lowercase string), `python_functions` (write a small f(...) judged by hidden tests run in
the sandbox). Each module holds its `Config` (the difficulty knobs), `sample(rng, config)`,
`check(problem, response)` (the verifier) and `MAX_RESPONSE_BYTES`; `glm5_jax.rl.rewards`
puts the length and truncation guards around `check`. Prompts and answers are tens of
bytes, sized for a byte-level model (GLM-5, arXiv 2602.15763, section 3: reasoning RL on
verifiable rewards, here at toy scale).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np

from glm5_jax.rl.tasks import arith
from glm5_jax.rl.tasks import problem as problem_lib
from glm5_jax.rl.tasks import python_functions
from glm5_jax.rl.tasks import strings
from glm5_jax.rl.tasks.problem import HELDOUT_FRACTION
from glm5_jax.rl.tasks.problem import Problem
from glm5_jax.rl.tasks.problem import SPLITS
from glm5_jax.rl.tasks.problem import prompt_messages
from glm5_jax.rl.tasks.problem import sft_record
from glm5_jax.rl.tasks.problem import split_of

_MODULES = {m.NAME: m for m in (arith, strings, python_functions)}

__all__ = ["HELDOUT_FRACTION", "Problem", "SPLITS", "Task", "get", "names", "prompt_messages",
           "sft_record", "split_of"]


@dataclasses.dataclass(frozen=True)
class Task:
  """A task with its options fixed: draws problems, writes SFT data, verifies responses.

  check(problem, response) -> float in [0, 1]: the bare verifier; RL uses
  `rewards.get(name)`, which adds the length cap and the truncation rule.
  """
  name: str
  config: Any
  sample: Callable[[np.random.Generator], problem_lib.Content]
  check: Callable[[Problem, str], float]
  max_response_bytes: int

  def problems(self, split: str, n: int, seed: int) -> list[Problem]:
    """n distinct problems of `split` ("train" / "heldout"), deterministic for `seed`."""
    return problem_lib.draw(self.name, self.sample, split, n, seed)

  def sft_record(self, problem: Problem, *, system: str | None = None) -> dict:
    return problem_lib.sft_record(problem, system=system)

  def write_sft(self, path: str, n: int, seed: int, *, system: str | None = None) -> int:
    """Writes n training conversations (JSONL, one `sft_record` a line); returns n."""
    return problem_lib.write_jsonl(path, self.problems("train", n, seed), system=system)


def names() -> tuple[str, ...]:
  return tuple(_MODULES)


def get(name: str, **options) -> Task:
  """The task `name` with `options` overriding its Config's defaults."""
  if name not in _MODULES:
    raise ValueError(f"task {name!r} (config.rl.task) is unknown; expected one of {names()}")
  module = _MODULES[name]
  known = tuple(f.name for f in dataclasses.fields(module.Config))
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(f"task {name!r} has no option(s) {unknown}; expected some of {known}")
  config = module.Config(**options)
  return Task(name, config, functools.partial(module.sample, config=config), module.check,
              module.MAX_RESPONSE_BYTES)
