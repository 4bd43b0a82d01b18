"""What does this line print? "py: print(sum(range(37)))" -> call python -> "666".

A one-line program from a few templates (sums, set sizes, reversals, sorting, digit sums of
powers) over random numbers and lowercase words: the answer is what it prints, out of reach
of a tiny byte-level model without running it. The SFT solution calls `python(code=...)`
with the line, reads the output and answers it (GLM-5, arXiv 2602.15763, section 3: tool
use with a code interpreter, here at toy scale). The verifier compares the answer with the
printed line exactly (surrounding whitespace ignored).

The programs are ours, so the reference output is computed in-process (`_run`) instead of
in the sandbox (writing thousands of SFT records would start thousands of sandboxes);
tests/rl/test_tools.py checks that the sandbox prints the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import numpy as np

from glm5_jax.rl.envs.tasks import problem as problem_lib

NAME = "tool_python"
TOOLS = ("python",)
MAX_RESPONSE_BYTES = 32
PREFIX = "py: "
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEMPLATES = {
    "sum_range": lambda r: f"print(sum(range({int(r.integers(10, 1000))})))",
    "set_len": lambda r: f"print(len(set({_word(r, 8, 14)!r})))",
    "reverse": lambda r: f"print({_word(r, 5, 9)!r}[::-1])",
    "sorted": lambda r: f"print(''.join(sorted({_word(r, 5, 9)!r})))",
    "digit_sum": lambda r: (f"print(sum(map(int, str({int(r.integers(2, 10))}**"
                            f"{int(r.integers(5, 30))}))))"),
}


def _word(rng, lo, hi) -> str:
  return "".join(_LETTERS[int(i)] for i in rng.integers(0, 26, int(rng.integers(lo, hi))))


@dataclasses.dataclass(frozen=True)
class Config:
  """templates: names from TEMPLATES to draw from."""
  templates: tuple[str, ...] = tuple(TEMPLATES)

  def __post_init__(self):
    names = tuple(self.templates) if isinstance(self.templates, (list, tuple)) else ()
    object.__setattr__(self, "templates", names)
    if not names or not set(names) <= set(TEMPLATES):
      raise ValueError(f"tool_python templates={self.templates!r}: expected a non-empty "
                       f"subset of {tuple(TEMPLATES)}")


_BUILTINS = {f.__name__: f for f in (print, sum, range, len, set, sorted, map, int, str)}


def _run(code: str) -> str:
  """stdout of one of our template lines (trusted code), as the sandbox would print it."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(code, {"__builtins__": dict(_BUILTINS)})  # pylint: disable=exec-used
  return out.getvalue()


def sample(rng: np.random.Generator, config: Config) -> problem_lib.Content:
  """Prompt "py: <line>", answer what the line prints (without the newline)."""
  code = TEMPLATES[config.templates[int(rng.integers(len(config.templates)))]](rng)
  return problem_lib.Content(PREFIX + code, _run(code).strip())


def solution_calls(problem) -> list[dict]:
  return [{"name": "python", "arguments": {"code": problem.prompt[len(PREFIX):]}}]


def solution_results(problem) -> list[str]:
  """The tool output of `solution_calls` (what the sandbox prints)."""
  return [_run(problem.prompt[len(PREFIX):])]


check = problem_lib.exact_answer
