"""Rewards: each task's verifier behind reward-hacking guards, and a call that cannot fail.

  fn = rewards.get("arith")                 # fn(problem, response, *, truncated) -> [0, 1]
  r, err = rewards.safe_call(fn, problem, response, truncated=False)

`response` is the assistant's visible answer (the text after the reasoning block). Rule
guards, applied before the task's verifier (GLM-5, arXiv 2602.15763, section 3: rule-based
rewards; as verl's `verl/utils/reward_score/gsm8k.py` in its strict mode, an answer not in
the expected form scores 0, no partial credit for format):
  1. truncated (generation hit the length limit before its stop token) -> 0: a cut-off
     answer is never rewarded, so the policy is not paid for running long;
  2. longer than the task's MAX_RESPONSE_BYTES (UTF-8 bytes, before any stripping) -> 0;
  3. the task's `check`: exact format and correctness (arith / strings: the canonical answer
     exactly, leading and trailing whitespace " \\t\\r\\n" ignored; python_functions: hidden
     tests in the sandbox, see that module).

`safe_call` turns an exception raised by a reward function, or a value outside [0, 1], into
reward 0 and an error string, so that one bad verifier call cannot stop the trainer (as
AReaL's `areal/reward/gsm8k.py` returns 0 on an exception; the string is for the trainer to
log or to count as an environment failure, which GLM-5's asynchronous RL records and filters).
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable

import numpy as np

from glm5_jax.rl.envs import tasks
from glm5_jax.rl.envs.tasks import Problem

RewardFn = Callable[..., float]   # fn(problem, response, *, truncated) -> float in [0, 1]


def guarded(problem: Problem, response: str, *, truncated: bool, task: str,
            check: Callable[[Problem, str], float], max_bytes: int) -> float:
  """check(problem, response) behind the guards above; bad arguments raise."""
  if not isinstance(problem, Problem):
    raise TypeError(f"problem: expected a tasks.Problem, got {type(problem).__name__}")
  if problem.task != task:
    raise ValueError(f"reward {task!r} got problem {problem.id!r} of task {problem.task!r}")
  if not isinstance(response, str):
    raise TypeError(f"response: expected str, got {type(response).__name__}")
  if not isinstance(truncated, (bool, np.bool_)):
    raise TypeError(f"truncated={truncated!r}: expected a bool")
  if bool(truncated) or len(response.encode("utf-8")) > max_bytes:
    return 0.0
  return float(check(problem, response))


def _build(name: str) -> RewardFn:
  task = tasks.get(name)
  return functools.partial(guarded, task=name, check=task.check,
                           max_bytes=task.max_response_bytes)


_REWARDS = {name: _build(name) for name in tasks.names()}


def names() -> tuple[str, ...]:
  return tuple(_REWARDS)


def get(name: str) -> RewardFn:
  """The reward function of task `name`: fn(problem, response, *, truncated) -> [0, 1]."""
  if name not in _REWARDS:
    raise ValueError(f"reward {name!r} (config.rl.task) is unknown; expected one of {names()}")
  return _REWARDS[name]


def safe_call(fn: RewardFn, problem: Problem, response: str, *,
              truncated: bool) -> tuple[float, str | None]:
  """(fn(problem, response, truncated=truncated), None), or (0.0, error text) when fn
  raises an Exception or returns something that is not a number in [0, 1]."""
  try:
    r = fn(problem, response, truncated=truncated)
  except Exception as e:  # pylint: disable=broad-exception-caught
    return 0.0, f"{type(e).__name__}: {e}"
  if not isinstance(r, numbers.Real) or not 0.0 <= r <= 1.0:   # NaN fails the range too
    return 0.0, f"reward {r!r}: expected a number in [0, 1]"
  return float(r), None


def task_and_reward(r):
  """The task and reward function of the config's `rl` section (errors name the fields)."""
  task = tasks.from_config(r)
  try:
    reward_fn = get(r.reward or r.task)
  except ValueError as e:
    raise ValueError(f"config.rl.reward={r.reward or r.task!r}: {e}") from None
  return task, reward_fn
