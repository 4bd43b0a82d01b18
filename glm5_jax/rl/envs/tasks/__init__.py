"""Verifiable tasks for reasoning RL on a small model, chosen by name (`config.rl.task`).

  task = tasks.get("arith", max_digits=3)     # options: the fields of arith.Config
  train = task.problems("train", 1000, seed=0)
  evals = task.problems("heldout", 500, seed=0)   # never overlaps any train draw
  task.write_sft("/tmp/arith.jsonl", 5000, seed=0)  # SFT conversations (train split)
  r = rewards.get("arith")(evals[0], "5535", truncated=False)

Tasks (one module each): `arith` (integer +, -, *), `strings` (reverse / sort / dedupe a
lowercase string), `python_functions` (write a small f(...) judged by hidden tests run in
the sandbox). Each module holds its `Config` (the difficulty knobs), `sample(rng, config)`,
`check(problem, response)` (the verifier) and `MAX_RESPONSE_BYTES`; `glm5_jax.rl.envs.rewards`
puts the length and truncation guards around `check`. Prompts and answers are tens of
bytes, sized for a byte-level model (GLM-5, arXiv 2602.15763, section 3: reasoning RL on
verifiable rewards, here at toy scale).

Tool tasks (`tool_names()`, multi-turn, run as `glm5_jax.rl.envs.agent.Episode`s): `tool_calc`
(arithmetic through a calculator), `tool_search` (name the stdlib module a few docstring
words describe, through BM25 search), `tool_python` (what a one-line program prints, through
the sandbox). Their modules add `TOOLS` (what an episode may call)
and `solution_calls(problem)`; their `sft_record` is the multi-turn tool-using solution
(`tool_common.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

import numpy as np

from glm5_jax.rl.envs.tasks import arith
from glm5_jax.rl.envs.tasks import problem as problem_lib
from glm5_jax.rl.envs.tasks import python_functions
from glm5_jax.rl.envs.tasks import strings
from glm5_jax.rl.envs.tasks import tool_calc
from glm5_jax.rl.envs.tasks import tool_common
from glm5_jax.rl.envs.tasks import tool_python
from glm5_jax.rl.envs.tasks import tool_search
from glm5_jax.rl.envs.tasks.problem import HELDOUT_FRACTION
from glm5_jax.rl.envs.tasks.problem import Problem
from glm5_jax.rl.envs.tasks.problem import SPLITS
from glm5_jax.rl.envs.tasks.problem import prompt_messages
from glm5_jax.rl.envs.tasks.problem import sft_record
from glm5_jax.rl.envs.tasks.problem import split_of

_MIX_STREAM = 7   # the random stream of `write_sft`'s demonstrator choices, apart from the draws
_MODULES = {m.NAME: m for m in (arith, strings, python_functions)}
# Multi-turn tasks solved with tools (glm5_jax/rl/envs/tools.py; episodes:
# glm5_jax/rl/envs/agent.py).
_TOOL_MODULES = {m.NAME: m for m in (tool_calc, tool_search, tool_python)}

__all__ = ["HELDOUT_FRACTION", "Problem", "SPLITS", "Task", "get", "names", "prompt_messages",
           "sft_record", "split_of", "tool_names"]


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
  tools: tuple[str, ...] = ()          # tool tasks: the tools an episode may call
  solution_calls: Callable[[Problem], list[dict]] | None = None   # tool tasks' SFT solution
  solution_results: Callable[[Problem], list[str]] | None = None  # its outputs, if known
  reasoning: Callable[[Problem], str] | None = None   # worked reasoning for SFT (think_fraction)

  def problems(self, split: str, n: int, seed: int) -> list[Problem]:
    """n distinct problems of `split` ("train" / "heldout"), deterministic for `seed`."""
    return problem_lib.draw(self.name, self.sample, split, n, seed)

  def sft_record(self, problem: Problem, *, system: str | None = None) -> dict:
    """The SFT conversation; a tool task's is multi-turn (tool_common.sft_record)."""
    if self.solution_calls is None:
      return problem_lib.sft_record(problem, system=system)
    known = None if self.solution_results is None else self.solution_results(problem)
    return tool_common.sft_record(problem, self.solution_calls(problem), allowed=self.tools,
                                  system=system, results=known)

  def prompt_messages(self, problem: Problem, *, system: str | None = None) -> list[dict]:
    """The conversation up to the assistant's first turn: [system?, user]."""
    return problem_lib.prompt_messages(problem, system=system)

  def write_sft(self, path: str, n: int, seed: int, *, system: str | None = None,
                no_tool_fraction: float = 0.0, think_fraction: float = 0.0) -> int:
    """Writes n training conversations (JSONL, one `sft_record` a line); returns n.

    Mixed demonstrators, each record's choice drawn with `seed`, so that the SFT model has
    two behaviours and RL has to learn which one pays (docs/post_training.md,
    docs/agentic_rl_results.md):
      no_tool_fraction (tool tasks): this fraction answers in one assistant turn, without
        calling the tool;
      think_fraction (tasks with `reasoning`, e.g. arith with ops='+'): this fraction carries
        the task's worked reasoning in the assistant's reasoning block (thinking on); the
        others have the empty block.
    """
    _check_fraction("no_tool_fraction", no_tool_fraction, self.solution_calls is not None,
                    f"task {self.name!r} calls no tools; it applies to {tool_names()}")
    _check_fraction("think_fraction", think_fraction, self.reasoning is not None,
                    f"task {self.name!r} writes no reasoning; it applies to "
                    f"{tuple(k for k, m in _MODULES.items() if hasattr(m, 'reasoning'))}")
    u = np.random.default_rng([int(seed), _MIX_STREAM]).random(n)
    records = []                 # all of them first: a bad option fails before the file opens
    for p, u_i in zip(self.problems("train", n, seed), u):
      if u_i < no_tool_fraction:
        records.append(problem_lib.sft_record(p, system=system))
      else:
        records.append(self.sft_record(p, system=system))
      if u_i < think_fraction:
        records[-1]["messages"][-1]["reasoning"] = self.reasoning(p)
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    return n


def _check_fraction(name: str, value, applies: bool, why_not: str):
  if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
    raise ValueError(f"{name}={value!r}: expected a number in [0, 1]")
  if value and not applies:
    raise ValueError(f"{name}={value}: {why_not}")


def names() -> tuple[str, ...]:
  """The single-turn tasks (`glm5_jax.rl.envs.rewards` and the synchronous GRPO take these)."""
  return tuple(_MODULES)


def tool_names() -> tuple[str, ...]:
  """The multi-turn tool tasks (run as `glm5_jax.rl.envs.agent.Episode`s)."""
  return tuple(_TOOL_MODULES)


def get(name: str, **options) -> Task:
  """The task `name` with `options` overriding its Config's defaults."""
  every = {**_MODULES, **_TOOL_MODULES}
  if name not in every:
    raise ValueError(f"task {name!r} (config.rl.task) is unknown; expected one of "
                     f"{names() + tool_names()}")
  module = every[name]
  known = tuple(f.name for f in dataclasses.fields(module.Config))
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise ValueError(f"task {name!r} has no option(s) {unknown}; expected some of {known}")
  config = module.Config(**options)
  return Task(name, config, functools.partial(module.sample, config=config), module.check,
              module.MAX_RESPONSE_BYTES, tuple(getattr(module, "TOOLS", ())),
              getattr(module, "solution_calls", None),
              getattr(module, "solution_results", None), getattr(module, "reasoning", None))


def from_config(r) -> Task:
  """The task of a config's `rl` section (a ConfigDict or a dict): `rl.task` with
  `rl.task_options`; errors name both fields."""
  try:
    return get(r["task"], **dict(r["task_options"]))
  except ValueError as e:
    raise ValueError(f"config.rl.task={r['task']!r} with config.rl.task_options="
                     f"{dict(r['task_options'])} (filled for the config's default task; give "
                     f"the chosen task's options): {e}") from None


def check_prompts_fit(lengths, r, what: str) -> None:
  """Refuses an `rl` section in which the task's prompts (token `lengths` of `what`, e.g. its
  held-out problems) leave no room to answer, or that a context policy would rewrite on
  every turn. The sync and async entry points share it (their fields mean the same)."""
  longest = max(lengths)
  if longest + 1 > r["max_len"]:
    raise ValueError(
        f"config.rl.max_len={r['max_len']}: the task's prompts take up to {longest} tokens "
        f"({what}); expected >= {longest + 1} (the prompt and one generated token), "
        f"{longest + r['max_new_tokens']} for a full answer of config.rl.max_new_tokens="
        f"{r['max_new_tokens']}")
  ctx = r.get("context")
  if ctx is not None and ctx["kind"] != "none" and ctx["max_tokens"] and (
      ctx["max_tokens"] < longest):
    raise ValueError(
        f"config.rl.context.max_tokens={ctx['max_tokens']}: below the task's prompts (up to "
        f"{longest} tokens, {what}), so config.rl.context.kind={ctx['kind']!r} would rewrite "
        f"every turn; expected >= {longest}")


def heldout_problems(task: Task, r, seed: int) -> list:
  """The `rl.eval_problems` held-out problems of `task` for `seed`; errors name the field."""
  try:
    return task.problems("heldout", r["eval_problems"], seed)
  except ValueError as e:
    raise ValueError(f"config.rl.eval_problems={r['eval_problems']}: {e}") from None
