"""Small Python functions judged by hidden tests: "f(x): x times 3 plus 1" ->
"def f(x): return x*3+1".

Each problem comes from a template of `TEMPLATES` (drawn uniformly from `templates`) with its
integer or letter parameters drawn at random; the reference answer is a one-line function.
The hidden tests are `n_tests` random argument tuples plus the template's boundary cases;
their expected results (computed here with the template's reference, in this process) never
enter the sandbox nor the prompt.

Verifying a response (GLM-5, arXiv 2602.15763, section 3: rule-based rewards from executed
tests, here unit tests the model never sees):
  1. the response (leading / trailing whitespace stripped) must parse as Python (no markdown
     fences) - checked here with `ast.parse`, nothing run;
  2. the sandbox runs a harness: it reads a per-call random nonce from stdin, executes the
     response in a fresh namespace, calls `f` on every hidden argument tuple and prints one
     line "<nonce> <JSON list of repr(result)>";
  3. reward 1 when the sandbox status is "ok" and exactly one stdout line starts with the
     nonce and its results equal the expected reprs (type-exact: 1 is not True, (1,) is not
     [1]); else 0. Code that crashes, hangs, runs out of memory or exits early scores 0.

Faking a pass: the model never sees the nonce, so a printed constant cannot match; code that
reads the nonce out of the harness's memory still has to print the right results for inputs
it was never shown, because the verdict is computed outside the sandbox. Prints of the
model's own are allowed (only the nonce line counts); a second nonce line fails.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import secrets
import string
from typing import Callable

import numpy as np

from glm5_jax.rl.envs import sandbox
from glm5_jax.rl.envs.tasks import problem as problem_lib

NAME = "python_functions"
MAX_RESPONSE_BYTES = 160
TIMEOUT_S = 2.0      # the hidden tests take milliseconds; this bounds an infinite loop
MEMORY_MB = 256
_INT_MAX = 1000      # integer arguments in [0, _INT_MAX)
_LIST_MAX_LEN = 6
_STR_MAX_LEN = 8


@dataclasses.dataclass(frozen=True)
class Template:
  """prompt / solution: format strings over the parameters; params(rng) -> {name: value};
  args: "x", "xs", "s" or "x, y" (ints, a list of ints, a lowercase string, two ints);
  reference(**params) -> the function; edges(**params) -> boundary argument tuples."""
  prompt: str
  solution: str
  params: Callable[[np.random.Generator], dict]
  args: str
  reference: Callable[..., Callable]
  edges: Callable[..., list[tuple]] = lambda **p: []


def _ints(**ranges):
  """params(rng) drawing each name uniformly from its inclusive (lo, hi)."""
  return lambda rng: {k: int(rng.integers(lo, hi + 1)) for k, (lo, hi) in ranges.items()}


def _interval(rng):
  a = int(rng.integers(0, 500))
  return {"a": a, "b": a + int(rng.integers(1, 500))}


def _two_letters(rng):
  c, d = rng.choice(list(string.ascii_lowercase), size=2, replace=False)
  return {"c": str(c), "d": str(d)}


TEMPLATES = {
    "mul_add": Template(
        "f(x): x times {a} plus {b}", "def f(x): return x*{a}+{b}", _ints(a=(2, 99), b=(1, 99)),
        "x", lambda a, b: lambda x: x * a + b, lambda a, b: [(0,), (1,)]),
    "mod_add": Template(
        "f(x): x mod {a} plus {b}", "def f(x): return x%{a}+{b}", _ints(a=(2, 99), b=(1, 99)),
        "x", lambda a, b: lambda x: x % a + b, lambda a, b: [(0,), (a,), (a - 1,)]),
    "between": Template(
        "f(x): is x between {a} and {b}", "def f(x): return {a}<=x<={b}", _interval,
        "x", lambda a, b: lambda x: a <= x <= b,
        lambda a, b: [(a - 1,), (a,), (b,), (b + 1,)]),
    "divisible": Template(
        "f(x): is x divisible by {a} or {b}", "def f(x): return x%{a}==0 or x%{b}==0",
        _ints(a=(2, 19), b=(20, 99)), "x", lambda a, b: lambda x: x % a == 0 or x % b == 0,
        lambda a, b: [(a,), (b,), (a * b + 1,)]),
    "clamp": Template(
        "f(x): x clamped to {a}..{b}", "def f(x): return min(max(x,{a}),{b})", _interval,
        "x", lambda a, b: lambda x: min(max(x, a), b),
        lambda a, b: [(a - 1,), (a,), (b,), (b + 1,)]),
    "sum_mul_add": Template(
        "f(xs): sum of xs times {a} plus {b}", "def f(xs): return sum(xs)*{a}+{b}",
        _ints(a=(2, 99), b=(1, 99)), "xs", lambda a, b: lambda xs: sum(xs) * a + b,
        lambda a, b: [([],)]),
    "keep_between": Template(
        "f(xs): items of xs between {a} and {b}",
        "def f(xs): return [x for x in xs if {a}<=x<={b}]", _interval, "xs",
        lambda a, b: lambda xs: [x for x in xs if a <= x <= b],
        lambda a, b: [([],), ([a - 1, a, b, b + 1],)]),
    "map_mul_add": Template(
        "f(xs): each item of xs times {a} plus {b}", "def f(xs): return [x*{a}+{b} for x in xs]",
        _ints(a=(2, 99), b=(1, 99)), "xs", lambda a, b: lambda xs: [x * a + b for x in xs],
        lambda a, b: [([],)]),
    "count_above": Template(
        "f(xs): how many items of xs are above {a}",
        "def f(xs): return len([x for x in xs if x>{a}])", _ints(a=(0, _INT_MAX - 1)), "xs",
        lambda a: lambda xs: sum(x > a for x in xs), lambda a: [([],), ([a, a + 1],)]),
    "replace": Template(
        "f(s): s with {c} replaced by {d}", "def f(s): return s.replace('{c}','{d}')",
        _two_letters, "s", lambda c, d: lambda s: s.replace(c, d),
        lambda c, d: [("",), (c + d + c,)]),
    "count_two": Template(
        "f(s): how many letters of s are {c} or {d}",
        "def f(s): return s.count('{c}')+s.count('{d}')", _two_letters, "s",
        lambda c, d: lambda s: sum(ch in (c, d) for ch in s), lambda c, d: [("",), (c + d + c,)]),
    "two_args": Template(
        "f(x, y): x times {a} plus y times {b}", "def f(x, y): return x*{a}+y*{b}",
        _ints(a=(2, 99), b=(2, 99)), "x, y", lambda a, b: lambda x, y: x * a + y * b,
        lambda a, b: [(0, 0), (1, 0), (0, 1)]),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """templates: names from TEMPLATES to draw from; n_tests: random hidden tests per problem
  (1..32), on top of each template's boundary cases."""
  templates: tuple[str, ...] = tuple(TEMPLATES)
  n_tests: int = 6

  def __post_init__(self):
    names = (self.templates,) if isinstance(self.templates, str) else self.templates
    names = tuple(names) if isinstance(names, (list, tuple)) else ()
    if not names or not set(names) <= set(TEMPLATES) or len(set(names)) != len(names):
      raise ValueError(f"python_functions templates={self.templates!r}: expected distinct "
                       f"names from {tuple(TEMPLATES)}")
    object.__setattr__(self, "templates", names)
    if not isinstance(self.n_tests, int) or not 1 <= self.n_tests <= 32:
      raise ValueError(f"python_functions n_tests={self.n_tests!r}: expected 1..32")


def _random_args(rng: np.random.Generator, kind: str, letters: str) -> tuple:
  """One hidden argument tuple of `kind`; strings are drawn over `letters`."""
  if kind == "x":
    return (int(rng.integers(0, _INT_MAX)),)
  if kind == "x, y":
    return (int(rng.integers(0, _INT_MAX)), int(rng.integers(0, _INT_MAX)))
  if kind == "xs":
    return ([int(v) for v in rng.integers(0, _INT_MAX, size=rng.integers(1, _LIST_MAX_LEN + 1))],)
  if kind == "s":
    return ("".join(letters[i] for i in rng.integers(len(letters), size=rng.integers(
        1, _STR_MAX_LEN + 1))),)
  raise ValueError(f"template args={kind!r}: expected 'x', 'x, y', 'xs' or 's'")


def sample(rng: np.random.Generator, config: Config) -> problem_lib.Content:
  """One problem: a template with drawn parameters, its solution and hidden tests."""
  t = TEMPLATES[config.templates[int(rng.integers(len(config.templates)))]]
  p = t.params(rng)
  fn = t.reference(**p)
  letters = "".join(sorted(set("abc") | {p.get("c", "a"), p.get("d", "b")}))
  calls = [_random_args(rng, t.args, letters) for _ in range(config.n_tests)] + t.edges(**p)
  tests = tuple((repr(args), repr(fn(*args))) for args in calls)
  return problem_lib.Content(t.prompt.format(**p), t.solution.format(**p), tests)


_HARNESS = """\
import json as _json, sys as _sys
_nonce = _sys.stdin.readline().strip()
_ns = {{"__name__": "solution"}}
exec(compile({code!r}, "<solution>", "exec"), _ns)
_results = [repr(_ns["f"](*_args)) for _args in [{args}]]
_sys.stdout.write("\\n" + _nonce + " " + _json.dumps(_results) + "\\n")
"""


def harness(problem: problem_lib.Problem, code: str) -> str:
  """The program the sandbox runs: `code`, then f on each hidden argument tuple."""
  return _HARNESS.format(code=code, args=", ".join(args for args, _ in problem.tests))


def _passed(stdout: str, nonce: str, expected: list[str]) -> bool:
  lines = [l for l in stdout.splitlines() if l.startswith(nonce + " ")]
  if len(lines) != 1:
    return False
  try:
    return json.loads(lines[0][len(nonce) + 1:]) == expected
  except ValueError:
    return False


def check(problem: problem_lib.Problem, response: str) -> float:
  """1.0 when the response's f passes every hidden test in the sandbox, else 0.0.

  A sandbox that cannot be set up raises `sandbox.SandboxError` (an environment failure,
  not a wrong answer); `rewards.safe_call` reports it as the error text with reward 0.
  """
  code = response.strip(problem_lib.WHITESPACE)
  try:
    ast.parse(code)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return 0.0
  if not problem.tests:
    raise ValueError(f"problem {problem.id!r} has no hidden tests")
  nonce = secrets.token_hex(16)
  result = sandbox.run_python(harness(problem, code), stdin=nonce + "\n", timeout_s=TIMEOUT_S,
                              memory_mb=MEMORY_MB)
  if result.status != "ok":
    return 0.0
  return float(_passed(result.stdout, nonce, [want for _, want in problem.tests]))
